"""Managed collision's C++ library out of memory (`recshard.distributed.mc_native`): a call
that cannot get its scratch raises MemoryError naming the operation and changes nothing (the
process lives: a std::bad_alloc through ctypes aborted it), and the same call with memory back
gives the torch path's result. The address space is capped in a subprocess, at steps from just
past what the process uses, so the cap falls on each of the eviction's allocations in turn."""

from __future__ import annotations

import pytest
import torch

from recshard.distributed import mc_library, mc_native
from recshard.sparse import KeyedJaggedTensor
from tests.python_script import run_script

pytestmark = pytest.mark.skipif(
    not mc_library.available(), reason="recshard.distributed._mc_index is not built"
)

# argv: which call. Prints "ours N", N the capped calls that raised the library's MemoryError
# (each checked to change nothing), then "agree" once the call with memory back matched torch's.
OUT_OF_MEMORY = r"""
import resource, sys
import torch
from recshard.distributed import mc_library, mc_native
from recshard.modules.mc_compete import rank_contest
from recshard.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from recshard.sparse import JaggedTensor

MIB = 1 << 20
torch.manual_seed(0)


def capped(call, state, what):
    # call under caps of 1, 2, 3, ... MiB past the address space in use until it returns;
    # each MemoryError of the library must leave `state()` as it was
    before, ours = [t.clone() for t in state()], 0
    for margin in range(1, 256):
        used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (used + margin * MIB, resource.RLIM_INFINITY))
        try:
            return call(), ours
        except MemoryError as error:
            if f"managed collision {what}" in str(error):
                ours += 1
                assert all(torch.equal(a, b) for a, b in zip(before, state())), "changed"
        except RuntimeError as error:  # torch's own allocation, before the library's
            assert "managed collision" not in str(error), error
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
    return call(), ours


def module(index):
    m = MCHManagedCollisionModule(4096, "cpu", LFU_EvictionPolicy(), 1000, 2**40, buckets=8)
    if index is not None:
        m.use_kernels(index, mc_native.native_contest)
        assert m._lfu_index is not None
    return m


def filled(native, reference):
    # both modules after a fill of 3000 ids, then half a million ids seen (2000 held)
    first = torch.randint(0, 2**40, (3000,))
    batch = torch.cat([first[:2000], torch.randint(0, 2**40, (1 << 19,))])
    for ids in (first, batch):
        features = {"f": JaggedTensor(ids, lengths=torch.tensor([ids.numel()]))}
        native(features), reference(features)
        if ids is first:
            native._coalesce_and_evict(1), reference._coalesce_and_evict(1)
            assert native.evict().tolist() == reference.evict().tolist()
    return batch


def agree(native, reference, batch):
    assert torch.equal(native._mch_raw_ids, reference._mch_raw_ids)
    assert torch.equal(native._mch_counts, reference._mch_counts)
    assert native.evict().tolist() == reference.evict().tolist()
    features = {"f": JaggedTensor(batch, lengths=torch.tensor([batch.numel()]))}
    assert torch.equal(native(features)["f"].values(), reference(features)["f"].values())


def state_of(*modules):
    index = lambda m: m.id_index()
    return lambda: [t for m in modules for t in (m._mch_raw_ids, m._mch_counts, index(m).slots)]


if sys.argv[1] == "eviction":
    native, reference = module(mc_native.NativeIdIndex()), module(None)
    batch = filled(native, reference)
    state = state_of(native)
    _, ours = capped(lambda: native._coalesce_and_evict(2), state, "LFU eviction")
    reference._coalesce_and_evict(2)
    agree(native, reference, batch)
elif sys.argv[1] == "tables":  # two modules' evictions in one call: the second's scratch too
    natives = [module(mc_native.NativeIdIndex()) for _ in range(2)]
    references = [module(None) for _ in range(2)]
    batches = [filled(n, r) for n, r in zip(natives, references)]

    def both():
        calls = [m.lfu_eviction() for m in natives]
        for m, (rows, evicted) in zip(natives, mc_native.evict_lfu_tables(calls)):
            m.lfu_evicted(rows, evicted)

    _, ours = capped(both, state_of(*natives), "LFU eviction")
    for n, r, b in zip(natives, references, batches):
        r._coalesce_and_evict(2)
        agree(n, r, b)
else:
    rows = torch.zeros(64, dtype=torch.float64)
    held = torch.arange(64)
    news = torch.rand(1 << 20, dtype=torch.float64) + 1
    state = lambda: (rows, held, news)
    (lose, win), ours = capped(lambda: mc_native.native_contest(rows, held, news), state, "contest")
    want_lose, want_win = rank_contest(rows, held, news)
    assert lose.tolist() == want_lose.tolist() and win.tolist() == want_win.tolist()
print("ours", ours)
print("agree")
"""


@pytest.mark.parametrize("call", ["eviction", "tables", "contest"])
def test_no_memory_for_scratch_changes_nothing_then_matches_torch(call: str) -> None:
    """An LFU eviction of half a million ids (2000 held), two such in one call, and a contest
    of a million new ids,
    capped at 1, 2, ... MiB past the address space in use: each cap that reaches the C++
    scratch raises MemoryError with the module's ids, counts and index unchanged (before the
    fix: SIGABRT, or counts already added); uncapped, the torch path's rows, ids and counts."""
    result = run_script(OUT_OF_MEMORY, call)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split()
    assert lines[-1] == "agree", result.stdout + result.stderr[-3000:]
    if int(lines[lines.index("ours") + 1]) == 0:
        pytest.skip("the address-space cap never fell on the library's scratch (torch's first)")


def test_route_too_large_for_memory_is_an_error() -> None:
    """Routing to more ranks than a vector can count (2**61: no scratch for the per-rank
    counts) raises MemoryError, not an abort; no bag is routed, so nothing else is needed."""
    empty = torch.zeros(0, dtype=torch.int64)
    features = KeyedJaggedTensor(["f"], empty, lengths=empty)
    zero, one = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(MemoryError, match="managed collision routing: out of memory"):
        mc_native.route(features, zero, one, zero, zero, 2**61)
