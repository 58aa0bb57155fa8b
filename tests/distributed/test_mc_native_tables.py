"""Several modules' LFU evictions in one C++ call (`mc_native.evict_lfu_tables`, which a
`ShardedManagedCollisionCollection` makes for all its modules evicting at a step): against
each module evicting on its own (its index's `evict_lfu`, one table a call) and the torch path,
after every step of many, for tables of different sizes, bucket counts and bucket ranges, some
with nothing seen: the same ids, rows, counts, evicted rows, counters, history and index. And
a bad table anywhere in the call refuses the call before any table is written."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from recshard.distributed import mc_library, mc_native
from recshard.modules.mc_index import LfuEviction
from recshard.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from tests.distributed.mc_cases import bucket_universe, skewed_ids

pytestmark = pytest.mark.skipif(
    not mc_library.available(), reason="recshard.distributed._mc_index is not built"
)

# (zch, buckets, bucket range): one bucket, a slice of the buckets, buckets of one row and the
# reserved one, a large table
TABLES = [(40, 1, None), (90, 6, (2, 5)), (16, 8, None), (600, 4, (1, 3)), (2000, 3, None)]


def _modules(native: bool) -> List[MCHManagedCollisionModule]:
    out = []
    for zch, buckets, bucket_range in TABLES:
        module = MCHManagedCollisionModule(
            zch, "cpu", LFU_EvictionPolicy(), 1, 2**40, buckets=buckets, bucket_range=bucket_range
        )
        if native:
            module.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
        out.append(module)
    return out


def _ids(gen: torch.Generator, module: MCHManagedCollisionModule, step: int) -> torch.Tensor:
    """Skewed draws of the module's buckets' ids (repeats, hits, ties); none at some steps."""
    zch = module.output_size()
    if (step + zch) % 5 == 0:
        return torch.empty(0, dtype=torch.int64)
    n = int(torch.randint(1, 3 * zch, (1,), generator=gen))
    return skewed_ids(gen, bucket_universe(module), n)


def _state(module: MCHManagedCollisionModule) -> Tuple[object, ...]:
    return (
        module._mch_raw_ids.tolist(),
        module._mch_counts.tolist(),
        module.history_length(),
        module.metrics(reset=False),
        int(module._current_iter_tensor),
    )


@pytest.mark.parametrize("seed", range(3))
def test_one_call_for_many_tables_equals_each_on_its_own_and_torch(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batched, alone, reference = _modules(True), _modules(True), _modules(False)
    for step in range(15):
        for trio in zip(batched, alone, reference):
            ids = _ids(gen, trio[0], step)
            assert all(m.record(ids) for m in trio)  # interval 1: every step evicts
        due = [(m, m.lfu_eviction()) for m in batched]
        calls = [(m, call) for m, call in due if call is not None]
        assert all(call is None for m, call in due if not m.history_length())
        results = mc_native.evict_lfu_tables([call for _, call in calls])
        for (module, _), (rows, evicted) in zip(calls, results):
            module.lfu_evicted(rows, evicted)
        for module in alone + reference:
            module.run_eviction()
        for t, trio in enumerate(zip(batched, alone, reference)):
            states = [_state(m) for m in trio]
            assert states[0] == states[1] == states[2], f"step {step}, table {t}"
            evicted = [m.evict() for m in trio]
            assert len({None if e is None else tuple(e.tolist()) for e in evicted}) == 1
            assert len(trio[0].id_index()) == len(trio[1].id_index()) == trio[0].rows_in_use()
    losing = [m.metrics(reset=False)["evicted"] > 0 for m in batched]
    assert sum(losing) >= 3, "held ids seldom lost their rows: the test exercised little"
    for module, want in zip(batched, reference):  # the index answers every id as the rows say
        ids = _ids(gen, module, 1)
        assert torch.equal(module.remap_ids(ids), want.remap_ids(ids))
        module.validate_state()
        assert torch.equal(module.remap_ids(ids), want.remap_ids(ids))


def _call(module: MCHManagedCollisionModule, **changes: object) -> tuple:
    index, eviction = module.lfu_eviction()  # type: ignore[misc]
    fields = {**eviction.__dict__, **changes}
    return index, LfuEviction(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"bucket_starts": torch.tensor([0, 3, 90])}, "arguments the library refused"),
        ({"first_bucket": 4}, "arguments the library refused"),  # past the buckets
        ({"ids": torch.tensor([5, -1])}, "an id outside its range"),
        ({"ids": torch.tensor([6 * 7 + 1])}, "not holding its bucket"),  # bucket 1: not held
        ({"counts": torch.zeros(44, dtype=torch.int64)}, "counts must have 45 elements"),
        # a strided view: refused, not copied (a copy's address would outlive the copy)
        ({"ids": torch.tensor([6 * 7 + 2, 0, 6 * 9 + 3, 0])[::2]}, "ids seen must be a contig"),
    ],
)
def test_a_bad_table_refuses_the_call_before_any_table_is_written(bad: dict, error: str) -> None:
    """Table 1 (after a good table 0 with held ids and new ones) is bad: nothing of either is
    written, and the call then succeeds with table 1 mended."""
    first, second = _modules(True)[:2]
    for step in range(2):
        first.record(torch.tensor([3, 5, 3, 7 + step]))
        second.record(torch.tensor([6 * 7 + 2, 6 * 9 + 3, 6 * 7 + 2]))
        if step == 0:
            first.run_eviction()
            second.run_eviction()
    before = [
        [t.clone() for t in (m._mch_raw_ids, m._mch_counts, m.id_index().slots)]
        + [len(m.id_index()), m.history_length()]
        for m in (first, second)
    ]
    with pytest.raises((RuntimeError, ValueError), match=error):
        mc_native.evict_lfu_tables([_call(first), _call(second, **bad)])
    after = [
        [t for t in (m._mch_raw_ids, m._mch_counts, m.id_index().slots)]
        + [len(m.id_index()), m.history_length()]
        for m in (first, second)
    ]
    for was, now in zip(before, after):
        assert all(torch.equal(a, b) for a, b in zip(was[:3], now[:3])) and was[3:] == now[3:]
    results = mc_native.evict_lfu_tables([_call(first), _call(second)])
    assert results[0][0].numel() == 1 and results[1][0].numel() == 0  # id 8 gets a free row
    assert first._mch_counts[first._mch_raw_ids == 3].tolist() == [4]
