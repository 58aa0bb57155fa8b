"""The calibrated per-rank fixed memory of a sharded step and the data-parallel gradient
buffers in the cpu storage estimate (issue #22, memory target)."""

from __future__ import annotations

import pytest

from recshard.calibration.memory import measure_rank_overhead
from recshard.planner import EmbeddingShardingPlanner, TableMeta, Topology
from recshard.planner.cost.plan_stats import plan_stats
from recshard.planner.cost.storage import EmbeddingStorageEstimator
from recshard.planner.profile import CalibrationProfile, MemoryCost
from recshard.sharding.data_parallel import ROW_EXCHANGE_MIN_BYTES


@pytest.mark.slow  # 25-215 s on 2 busy cores: make test stays under 15 min
def test_rank_overhead_is_measured_in_fresh_ranks():
    overhead = measure_rank_overhead()
    # real fresh two-rank gloo processes: a sharded step grows each by megabytes, not GBs
    assert overhead is not None and 1 << 20 < overhead < 1 << 30


def test_rank_overhead_is_added_once_per_rank_on_cpu_only():
    tables = [TableMeta(f"t{i}", 1000, 16, pooling_factors=[2.0]) for i in range(3)]
    plan = EmbeddingShardingPlanner(Topology(2), 64, debug=False).plan_tables(tables)
    memory = MemoryCost(1.0, 0.0, 1.0)
    without = plan_stats(
        plan, tables, Topology(2, profile=CalibrationProfile("cpu", 1, memory=memory)), 64
    )
    memory_with = MemoryCost(1.0, 0.0, 1.0, rank_overhead_bytes=7e6)
    topo = Topology(2, profile=CalibrationProfile("cpu", 1, memory=memory_with))
    stats = plan_stats(plan, tables, topo, 64)
    for a, b in zip(without.ranks, stats.ranks):
        assert b.memory == pytest.approx(a.memory + 7e6)  # every rank, once
    cuda = Topology(
        2, compute_device="cuda", profile=CalibrationProfile("cuda", 1, memory=memory_with)
    )
    cuda_plain = Topology(2, compute_device="cuda")
    assert [r.memory for r in plan_stats(plan, tables, cuda, 64).ranks] == [
        r.memory for r in plan_stats(plan, tables, cuda_plain, 64).ranks
    ]


def test_data_parallel_gradient_copies_on_cpu_with_a_profile():
    """Without a profile: weights and 2 gradient copies (unchanged); calibrated on cpu: a
    table averaged in place loses the second copy; no output-dist buffers (there is none)."""
    profile = CalibrationProfile("cpu", 1, memory=MemoryCost(1.0, 0.0, 1.0))
    small_rows = ROW_EXCHANGE_MIN_BYTES // (4 * 64) - 1  # shares the flattened all-reduce
    large_rows = 4 * small_rows  # averaged in place
    added = {}
    for rows in (small_rows, large_rows):
        table = TableMeta("t", rows, 64, pooling_factors=[1.0])
        args = (table, "data_parallel", "dense", rows, 64)
        plain = EmbeddingStorageEstimator(Topology(2), 512).estimate(*args)
        calibrated = EmbeddingStorageEstimator(Topology(2, profile=profile), 512).estimate(*args)
        assert 3 * 4.0 * rows * 64 < plain.ddr < 3.1 * 4.0 * rows * 64
        added[rows] = calibrated.ddr - plain.ddr
    assert added[small_rows] == pytest.approx(0.0)
    assert added[large_rows] == pytest.approx(-4.0 * large_rows * 64)
