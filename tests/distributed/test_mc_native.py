"""Managed collision's C++ path (recshard.distributed.mc_native) against the torch path: the
hash index against a dict through rebuilds and many evictions' erase + insert, the fused
remap against FusedRemap, the routing against route_to_owners, the id check, the buffers it
refuses; and the sharded collection picks it on CPU unless RECSHARD_NATIVE_MC=0."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from multiprocess import run_ranks

from recshard.distributed import mc_library, mc_native
from recshard.distributed.mc_modules import route_to_owners
from recshard.modules.mc_base import FREE
from recshard.modules.mc_compete import rank_contest
from recshard.modules.mc_fused import FusedRemap
from recshard.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from recshard.sparse import JaggedTensor, KeyedJaggedTensor

pytestmark = pytest.mark.skipif(
    not mc_library.available(), reason="recshard.distributed._mc_index is not built"
)


def test_native_index_matches_a_dict_through_evictions() -> None:
    """A small index (32 rows, 64 slots: long probe runs) after a rebuild and 300 rounds of
    erase + insert answers every id as a dict does (backward-shift deletion keeps runs whole)."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.full((32,), FREE, dtype=torch.int64)
    raw[:20] = torch.randperm(1000, generator=gen)[:20]
    index = mc_native.NativeIdIndex()
    index.rebuild(raw, 100)
    held = {int(i): 100 + r for r, i in enumerate(raw.tolist()) if i != FREE}
    free_rows = [r for r in range(32) if raw[r] == FREE]
    for _ in range(300):
        leaving = [i for i in held if torch.rand(1, generator=gen) < 0.3]
        rows = [held.pop(i) - 100 for i in leaving] + free_rows
        fresh = [i for i in torch.randint(0, 1000, (len(rows),), generator=gen).tolist()]
        fresh = [i for i in dict.fromkeys(fresh) if i not in held][: len(rows)]
        free_rows = rows[len(fresh) :]
        index.replace(
            torch.tensor(leaving, dtype=torch.int64),
            torch.tensor(fresh, dtype=torch.int64),
            torch.tensor(rows[: len(fresh)], dtype=torch.int64) + 100,
        )
        held.update({i: 100 + r for i, r in zip(fresh, rows)})
        assert len(index) == len(held)
    queries = torch.arange(1000)
    found, rows = index.find(queries)
    assert found.tolist() == [q in held for q in range(1000)]
    assert rows[found].tolist() == [held[q] for q in range(1000) if q in held]


def test_native_index_refuses_what_would_break_it() -> None:
    index = mc_native.NativeIdIndex()
    index.rebuild(torch.tensor([5, FREE, 7, FREE]), 0)
    with pytest.raises(RuntimeError, match="not held"):
        index.replace(torch.tensor([6]), torch.tensor([8]), torch.tensor([1]))
    index = mc_native.NativeIdIndex()
    index.rebuild(torch.tensor([5, FREE, 7, FREE]), 0)
    with pytest.raises(RuntimeError, match="inserted twice"):
        index.replace(torch.tensor([], dtype=torch.int64), torch.tensor([7]), torch.tensor([1]))
    with pytest.raises(ValueError, match="int64"):
        index.find(torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="their rows must have 1 elements"):
        index.replace(torch.tensor([5]), torch.tensor([9]), torch.tensor([0, 1]))


def _filled(zch: int, buckets: int, ids: torch.Tensor, native: bool) -> MCHManagedCollisionModule:
    module = MCHManagedCollisionModule(zch, "cpu", LFU_EvictionPolicy(), 1, 2**62, buckets=buckets)
    if native:
        module.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
    module({"f": JaggedTensor(ids, lengths=torch.tensor([ids.numel()]))})
    module.evict()
    return module


def _modules(native: bool) -> List[MCHManagedCollisionModule]:
    gen = torch.Generator().manual_seed(3)
    return [
        _filled(2000, 1, torch.randint(0, 2**40, (3000,), generator=gen), native),
        _filled(1500, 3, torch.randint(0, 2**40, (1500,), generator=gen), native),
        _filled(7, 2, torch.arange(20), native),  # tiny: most queries miss
    ]


def test_native_remap_matches_fused_remap() -> None:
    native, torch_modules = _modules(True), _modules(False)
    assert all(torch.equal(a._mch_raw_ids, b._mch_raw_ids) for a, b in zip(native, torch_modules))
    gen = torch.Generator().manual_seed(4)
    held = [m._mch_raw_ids[m._mch_raw_ids != FREE] for m in native]
    queries = [  # segments: table 0, 2, 1, 0 again, an empty one
        torch.cat([held[0][:900], torch.randint(0, 2**40, (300,), generator=gen)]),
        torch.arange(40),
        torch.cat([held[1][:500], torch.randint(0, 2**40, (200,), generator=gen)]),
        held[0][900:1000],
        torch.empty(0, dtype=torch.int64),
    ]
    segment_tables = torch.tensor([0, 2, 1, 0, 1])
    lengths = torch.tensor([q.numel() for q in queries])
    ids = torch.cat(queries)
    rows = mc_native.NativeFusedRemap(native).remap(ids, segment_tables, lengths)
    tables = torch.repeat_interleave(segment_tables, lengths)
    want = FusedRemap(torch_modules, torch.device("cpu")).remap(ids, tables)
    assert torch.equal(rows, want)
    for a, b in zip(native, torch_modules):
        assert a.metrics() == b.metrics()


def test_native_remap_refuses_ids_outside_its_buckets() -> None:
    module = _filled(20, 4, torch.arange(40), True)
    part = module.rebuild_with_bucket_range(1, 3)
    part.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
    remap = mc_native.NativeFusedRemap([part])
    remap.remap(torch.tensor([1, 2, 5]), torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="not holding its bucket"):
        remap.remap(torch.tensor([1, 4]), torch.tensor([0]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="refused"):
        remap.remap(torch.tensor([1, 5]), torch.tensor([0]), torch.tensor([3]))
    # lengths summing to 2**64 + 1: wrapped, that is the ids' count (read far past them)
    wrapping = torch.tensor([2**63 - 1, 2**63 - 1, 3])
    with pytest.raises(RuntimeError, match="refused"):
        remap.remap(torch.tensor([1]), torch.tensor([0, 0, 0]), wrapping)


def test_route_matches_route_to_owners() -> None:
    gen = torch.Generator().manual_seed(5)
    keys, stride, world = ["a", "b", "c"], 4, 3
    lengths = torch.randint(0, 5, (len(keys) * stride,), generator=gen)
    ids = torch.randint(0, 2**50, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(ids.numel(), generator=gen)
    kjt = KeyedJaggedTensor(keys, ids, weights, lengths=lengths.int())
    key_tables = torch.tensor([1, 0, 1])
    buckets = torch.tensor([3, 5])
    first_owners = torch.tensor([0, 3])
    owner_of_bucket = torch.tensor([0, 1, 2, 2, 2, 1, 0, 0])
    routed, sent_to = mc_native.route(kjt, key_tables, buckets, first_owners, owner_of_bucket, 3)
    tables = torch.repeat_interleave(key_tables, torch.tensor(kjt.length_per_key()))
    owners = owner_of_bucket[first_owners[tables] + ids % buckets[tables]]
    want, want_sent_to = route_to_owners(kjt, owners, world)
    assert routed.keys() == want.keys()
    assert torch.equal(routed.values(), want.values())
    assert torch.equal(routed.weights(), want.weights())
    assert torch.equal(routed.lengths(), want.lengths())
    assert routed.lengths().dtype == want.lengths().dtype
    assert torch.equal(sent_to, want_sent_to)


def test_ids_in_range() -> None:
    tables, lengths = torch.tensor([0, 1]), torch.tensor([2, 1])
    sizes = torch.tensor([10, 100])
    assert mc_native.ids_in_range(torch.tensor([0, 9, 99]), tables, lengths, sizes)
    assert not mc_native.ids_in_range(torch.tensor([0, 10, 5]), tables, lengths, sizes)
    assert not mc_native.ids_in_range(torch.tensor([0, 1, -1]), tables, lengths, sizes)
    with pytest.raises(RuntimeError, match="refused"):
        mc_native.ids_in_range(torch.tensor([0, 1]), tables, lengths, sizes)
    wrapping = torch.tensor([2**63 - 1, 2**63 - 1, 3])  # sums to 2**64 + 1, the ids' count wrapped
    with pytest.raises(RuntimeError, match="refused"):
        mc_native.ids_in_range(torch.tensor([0]), torch.tensor([0, 0, 0]), wrapping, sizes)


def _paths(rank: int, ws: int) -> Tuple[bool, bool]:
    from recshard.distributed import DistributedModelParallel
    from recshard.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
    )
    from recshard.distributed.mc_modules import ShardedManagedCollisionCollection
    from recshard.modules import EmbeddingBagCollection, EmbeddingBagConfig
    from recshard.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from recshard.modules.mc_modules import ManagedCollisionCollection

    tables = [EmbeddingBagConfig(10, 4, name="t", feature_names=["f"])]
    mcc = ManagedCollisionCollection(
        {"t": MCHManagedCollisionModule(10, "cpu", LFU_EvictionPolicy(), 2, buckets=ws)}, tables
    )
    module = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), mcc)
    dmp = DistributedModelParallel(
        module, sharders=[ManagedCollisionEmbeddingBagCollectionSharder()]
    )
    collection = next(m for m in dmp.modules() if isinstance(m, ShardedManagedCollisionCollection))
    return collection._native, collection._recorder is not None


@pytest.mark.parametrize("setting", ["", "0"])
def test_the_sharded_collection_remaps_in_cpp_unless_told(setting: str) -> None:
    """It remaps and records each step's ids in C++ (`mc_native_record`), or neither."""
    env = {mc_library.ENV: setting} if setting else {}
    assert run_ranks(1, _paths, env=env) == [(setting != "0", setting != "0")]


@pytest.mark.parametrize("seed", range(40))
def test_native_contest_matches_rank_contest(seed: int) -> None:
    """Buckets with free rows, tied scores among rows and new ids, more or fewer new ids than
    rows: the same rows change hands to the same ids, in the same pairs."""
    gen = torch.Generator().manual_seed(seed)
    slots = int(torch.randint(1, 30, (1,), generator=gen))
    news = int(torch.randint(0, 40, (1,), generator=gen))
    held = torch.randperm(100, generator=gen)[:slots]
    held[torch.rand(slots, generator=gen) < 0.3] = FREE
    row_scores = torch.randint(0, 4, (slots,), generator=gen).double()
    new_scores = torch.randint(0, 5, (news,), generator=gen).double()
    lose, win = mc_native.native_contest(row_scores, held, new_scores)
    want_lose, want_win = rank_contest(row_scores, held, new_scores)
    assert lose.tolist() == want_lose.tolist() and win.tolist() == want_win.tolist()
