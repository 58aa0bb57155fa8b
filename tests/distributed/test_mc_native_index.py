"""The C++ id index's slots (`mc_native.NativeIdIndex`): (id, row) pairs in one array, probe
runs that wrap past the array's end, deletion by backward shift across it. Ids are picked by
their home slot so every run crosses the end; `find`, the fused remap and the one-call LFU
eviction must answer the row of the id's own slot (a row read one slot off, or a shift that
stops at the end, gives another id's row or none)."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from recshard.distributed import mc_library, mc_native
from recshard.modules.mc_base import FREE
from recshard.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from recshard.sparse import JaggedTensor

pytestmark = pytest.mark.skipif(
    not mc_library.available(), reason="recshard.distributed._mc_index is not built"
)

_MIX = 0x9E3779B97F4A7C15  # mc_index.cpp's home_slot: (id * MIX mod 2**64)'s top log2 bits


def _home(key: int, log2: int) -> int:
    return ((key * _MIX) % 2**64) >> (64 - log2)


def _ids_at(home: int, log2: int, count: int) -> List[int]:
    """The `count` smallest ids whose home slot is `home`."""
    ids, key = [], 0
    while len(ids) < count:
        if _home(key, log2) == home:
            ids.append(key)
        key += 1
    return ids


def _probed(index: mc_native.NativeIdIndex, key: int) -> int | None:
    """`key`'s row read from the slots as documented (key at 2 s, row at 2 s + 1), by linear
    probing from its home slot."""
    pairs = index.slots.view(-1, 2).tolist()
    at = _home(key, index.log2)
    for _ in pairs:
        held, row = pairs[at]
        if held == key:
            return row
        if held == -1:
            return None
        at = (at + 1) % len(pairs)
    return None


def _assert_answers(
    index: mc_native.NativeIdIndex, held: Dict[int, int], others: List[int]
) -> None:
    """`find` and the slots give each held id its row, and the `others` none."""
    queries = list(held) + others
    found, rows = index.find(torch.tensor(queries))
    assert found.tolist() == [q in held for q in queries]
    assert rows.tolist() == [held.get(q, 0) for q in queries]
    assert [_probed(index, q) for q in queries] == [held.get(q) for q in queries]
    assert len(index) == len(held)


def test_runs_wrapping_past_the_end_and_shifts_across_it() -> None:
    """8 rows, 16 slots: ids at home 14, 15, 15, 14, 15, 0 fill slots 14, 15, 0, 1, 2, 3;
    erasing one shifts the run back across the end (the ids at home 15 past it stay, the
    others move), then a new id fills the row again."""
    log2 = 4
    at_14, at_15, at_0 = _ids_at(14, log2, 3), _ids_at(15, log2, 4), _ids_at(0, log2, 2)
    raw = torch.full((8,), FREE, dtype=torch.int64)
    raw[:6] = torch.tensor([at_14[0], at_15[0], at_15[1], at_14[1], at_15[2], at_0[0]])
    index = mc_native.NativeIdIndex()
    index.rebuild(raw, 1000)
    assert index.log2 == log2 and index.slots.numel() == 32
    held = {key: 1000 + r for r, key in enumerate(raw[:6].tolist())}
    pairs = index.slots.view(-1, 2)
    assert pairs[[14, 15, 0, 1, 2, 3]].tolist() == [[key, row] for key, row in held.items()]
    assert pairs[4:14].tolist() == [[-1, 0]] * 10
    _assert_answers(index, held, [at_14[2], at_15[3], at_0[1]])
    none = torch.tensor([], dtype=torch.int64)
    for leaving, fresh in [
        (at_14[0], at_15[3]),
        (at_15[1], at_0[1]),
        (at_15[0], at_14[2]),
        (at_0[0], at_14[0]),
    ]:
        row = held.pop(leaving)
        index.replace(torch.tensor([leaving]), none, none)
        _assert_answers(index, held, [leaving, fresh])
        index.replace(none, torch.tensor([fresh]), torch.tensor([row]))
        held[fresh] = row
        _assert_answers(index, held, [leaving])


def _module(native: bool) -> MCHManagedCollisionModule:
    module = MCHManagedCollisionModule(8, "cpu", LFU_EvictionPolicy(), 1, 2**40, buckets=1)
    if native:
        module.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
    return module


def test_eviction_and_remap_across_the_end_match_the_torch_path() -> None:
    """A module of 8 rows (7 to hand out, 16 index slots) whose ids all start probing at the
    last slot: each step's eviction erases and inserts across the end; the fused remap, the
    module's own remap and the rows, ids and counts agree with the torch path's."""
    native, reference = _module(True), _module(False)
    pool = _ids_at(15, 4, 12) + _ids_at(0, 4, 3)
    gen = torch.Generator().manual_seed(0)
    for step in range(10):
        # a few ids seen often (they take rows), the rest once
        ids = torch.tensor(pool)[torch.randperm(len(pool), generator=gen)]
        ids = torch.cat([ids[:5].repeat(step % 3 + 2), ids[5:]])
        features = {"f": JaggedTensor(ids, lengths=torch.tensor([ids.numel()]))}
        assert torch.equal(native(features)["f"].values(), reference(features)["f"].values())
        evicted, want = native.evict(), reference.evict()
        assert (evicted is None) == (want is None)
        assert evicted is None or evicted.tolist() == want.tolist()
        assert torch.equal(native._mch_raw_ids, reference._mch_raw_ids)
        assert torch.equal(native._mch_counts, reference._mch_counts)
        everything = torch.tensor(pool)
        rows = mc_native.NativeFusedRemap([native]).remap(
            everything, torch.tensor([0]), torch.tensor([everything.numel()])
        )
        raw = reference._mch_raw_ids.tolist()
        assert rows.tolist() == [raw.index(key) if key in raw else 7 for key in pool]
    assert native._mch_raw_ids.ne(FREE).sum() == 7
