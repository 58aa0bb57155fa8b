"""Every module's history record of a step in one C++ call (`mc_native_record.
NativeFusedRecord`, which a CPU `ShardedManagedCollisionCollection` makes at each training
step): against each module's own `record` of its ids, over many steps with evictions, for
policies with and without a last-access history, tables with no ids at some steps or none at
all, a table of two features and column-split features received twice (counted once), and
histories growing past their room: the same history arrays (entries and room), iterations,
evicting steps and state_dict, byte for byte; a checkpoint taken between evictions resumes
exactly. A state written in place is checked before use, and a refused call changes nothing."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from recshard.distributed import mc_library, mc_native, mc_native_record
from recshard.distributed.mc_native_record import NativeFusedRecord
from recshard.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHManagedCollisionModule,
)
from recshard.sparse import KeyedJaggedTensor
from tests.distributed.mc_cases import bucket_universe, skewed_ids

pytestmark = pytest.mark.skipif(
    not mc_library.available(), reason="recshard.distributed._mc_index is not built"
)

HASH = 2**40
# (policy, zch, buckets, bucket range, eviction interval)
TABLES = [
    (LFU_EvictionPolicy, 40, 1, None, 3),
    (LRU_EvictionPolicy, 90, 6, (2, 5), 2),
    (DistanceLFU_EvictionPolicy, 16, 8, None, 4),
    (LFU_EvictionPolicy, 600, 4, (1, 3), 5),
    (LRU_EvictionPolicy, 30, 2, (0, 1), 3),  # no feature: counts the iteration only
]
# feature -> table: table 0 has two features; "c" and "d" are column-split (received twice)
FEATURES = {"a": 0, "a2": 0, "b": 1, "c": 2, "d": 3}
WIRE, COLUMN = ["a", "b", "a2"], ["c", "d"]


def _modules() -> List[MCHManagedCollisionModule]:
    out = []
    for policy, zch, buckets, bucket_range, interval in TABLES:
        module = MCHManagedCollisionModule(
            zch, "cpu", policy(), interval, HASH, buckets=buckets, bucket_range=bucket_range
        )
        module.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
        out.append(module)
    return out


def _ids(gen: torch.Generator, module: MCHManagedCollisionModule, n: int) -> torch.Tensor:
    """`n` skewed draws of the module's buckets' ids (repeats, hits)."""
    return skewed_ids(gen, bucket_universe(module), n)


def _kjt(keys: List[str], parts: Dict[str, torch.Tensor]) -> KeyedJaggedTensor:
    lengths = torch.tensor([parts[k].numel() for k in keys])
    return KeyedJaggedTensor(keys, torch.cat([parts[k] for k in keys]), lengths=lengths)


def _step(
    gen: torch.Generator, modules: List[MCHManagedCollisionModule], step: int
) -> Tuple[List[KeyedJaggedTensor], List[torch.Tensor]]:
    """(the received KJTs: the wire features', then two column KJTs repeating "c" and "d"
    with other ids; each module's ids as the collection counts them: first KJT of a key)."""
    sizes = {f: int(torch.randint(0, 3 * modules[t].output_size(), (1,), generator=gen))
             for f, t in FEATURES.items()}  # fmt: skip
    if step % 4 == 1:
        sizes["b"] = 0  # a table with no ids this step
    if step == 7:
        sizes["d"] = 2500  # past table 3's history room
    first = {f: _ids(gen, modules[t], sizes[f]) for f, t in FEATURES.items()}
    again = {f: _ids(gen, modules[FEATURES[f]], 3) for f in COLUMN}
    received = [_kjt(WIRE, first), _kjt(COLUMN, first), _kjt(COLUMN[::-1], again)]
    per_table: List[List[torch.Tensor]] = [[] for _ in modules]
    for feature in WIRE + COLUMN:
        per_table[FEATURES[feature]].append(first[feature])
    return received, [torch.cat(p) if p else torch.empty(0, dtype=torch.int64) for p in per_table]


def _same_state(fused: MCHManagedCollisionModule, alone: MCHManagedCollisionModule) -> None:
    got, want = fused.state_dict(), alone.state_dict()
    assert list(got) == list(want)
    for name in want:
        a, b = got[name], want[name]
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
        assert a.numpy().tobytes() == b.numpy().tobytes(), name
    for a, b in zip(fused._history.arrays(), alone._history.arrays()):  # the same room
        assert (a is None) == (b is None) and (a is None or a.numel() == b.numel())


def _evict(modules: List[MCHManagedCollisionModule]) -> List[object]:
    for module in modules:
        module.run_eviction()
    return [None if (e := m.evict()) is None else e.tolist() for m in modules]


def _reloaded(modules: List[MCHManagedCollisionModule]) -> List[MCHManagedCollisionModule]:
    fresh = _modules()
    for module, old in zip(fresh, modules):
        module.load_state_dict(old.state_dict())
    return fresh


@pytest.mark.parametrize("seed", range(3))
def test_one_call_equals_each_module_recording_its_ids(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    fused, alone = _modules(), _modules()
    recorder = NativeFusedRecord(fused, FEATURES)
    evictions = grown = 0
    for step in range(24):
        if step == 11:  # a checkpoint between evictions, each loaded into fresh modules
            assert any(m.history_length() for m in fused)
            fused, alone = _reloaded(fused), _reloaded(alone)
            recorder = NativeFusedRecord(fused, FEATURES)
        received, ids = _step(gen, alone, step)
        room = [m._history.arrays()[0].numel() for m in fused]
        due = recorder.record(received)
        alone_due = [a for a, part in zip(alone, ids) if a.record(part)]
        assert alone_due == [alone[fused.index(m)] for m in due]
        grown += sum(m._history.arrays()[0].numel() > r for m, r in zip(fused, room))
        for f, a in zip(fused, alone):
            _same_state(f, a)
        assert _evict(due) == _evict([alone[fused.index(m)] for m in due])
        evictions += len(due)
        for f, a in zip(fused, alone):
            _same_state(f, a)
            assert f.metrics(reset=False) == a.metrics(reset=False)
    assert int(fused[4]._current_iter_tensor) == 24 and fused[4].history_length() == 0
    assert evictions >= 20 and grown >= 5, "few evictions or growths: the test exercised little"


def test_a_state_written_in_place_is_checked_before_any_module_records() -> None:
    modules = _modules()
    recorder = NativeFusedRecord(modules, FEATURES)
    gen = torch.Generator().manual_seed(0)
    received, _ = _step(gen, modules, 0)
    recorder.record(received)
    before = [m.state_dict() for m in modules]
    before = [{n: t.clone() for n, t in s.items()} for s in before]
    bad = modules[1]._mch_raw_ids
    bad[0] = 7 * 6 + 0  # bucket 0: not one of this module's (2, 5)
    with pytest.raises(ValueError):
        recorder.record(received)
    bad[0] = before[1]["_mch_raw_ids"][0]
    for module, state in zip(modules, before):
        for name, value in module.state_dict().items():
            assert torch.equal(value, state[name]), name
    epoch = modules[3]._index.epoch
    modules[3]._mch_raw_ids.copy_(before[3]["_mch_raw_ids"])  # valid: checked, index rebuilt
    recorder.record(received)
    assert modules[3]._index.epoch != epoch
    assert [int(m._current_iter_tensor) for m in modules] == [2] * len(modules)


def test_a_refused_record_changes_nothing() -> None:
    """A module whose counter is not int64 is refused in Python; a call the C++ side refuses
    (a module short of room after another's ids, bad segments) writes no module."""
    modules = _modules()
    recorder = NativeFusedRecord(modules, FEATURES)
    gen = torch.Generator().manual_seed(1)
    received, _ = _step(gen, modules, 0)
    recorder.record(received)

    def snapshot() -> List[Dict[str, torch.Tensor]]:
        return [{n: t.clone() for n, t in m.state_dict().items()} for m in modules]

    before = snapshot()
    modules[2]._current_iter_tensor = modules[2]._current_iter_tensor.to(torch.int32)
    with pytest.raises(ValueError, match="iteration counter must be a contiguous 1-D"):
        recorder.record(received)
    modules[2]._current_iter_tensor = modules[2]._current_iter_tensor.to(torch.int64)
    after = snapshot()
    for was, now in zip(before, after):
        assert all(torch.equal(was[n], now[n]) for n in was)

    arrays = [m._history.arrays() for m in modules]
    iterations = [m._current_iter_tensor for m in modules]
    used = [m.history_length() for m in modules]
    room = [a[0].numel() for a in arrays]
    room[1] = used[1]  # the second module (after the first's four ids) has no room for one
    ids = torch.arange(5, dtype=torch.int64) * 30
    columns = [  # as `mc_native_record.history_arguments` makes them, room[1] too small
        torch.tensor([a[0].data_ptr() for a in arrays]),
        torch.tensor([0 if a[1] is None else a[1].data_ptr() for a in arrays]),
        torch.tensor(room),
        torch.tensor([i.data_ptr() for i in iterations]),
    ]
    # no room; lengths past the ids; a negative length; tables outside [-1, 5)
    for tables, lengths in [([0, 1], [4, 1]), ([0, 1], [4, 2]), ([0, 1], [-1, 6]),
                            ([0, 5], [4, 1]), ([-2, 0], [4, 1])]:  # fmt: skip
        with pytest.raises(RuntimeError, match="arguments the library refused"):
            mc_native_record.record_histories(
                ids,
                torch.tensor(tables),
                torch.tensor(lengths),
                torch.tensor(used),
                [c.data_ptr() for c in columns],
            )
    for was, now in zip(before, snapshot()):
        assert all(torch.equal(was[n], now[n]) for n in was)
