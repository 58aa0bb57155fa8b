"""Cost model: hand-computed storage, optimizer state, and the direction of every perf term."""

from __future__ import annotations

import pytest

from recshard.modules import DataType
from recshard.plan.geometry import column_wise_sizes, row_wise_sizes
from recshard.planner import (
    EmbeddingEnumerator,
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
    TableMeta,
    Topology,
)
from recshard.planner.cost.estimators import optimizer_state_bytes
from recshard.planner.search.enumerator import column_runs, row_runs
from recshard.types import CacheParams, PipelineType


def test_optimizer_state_per_type():
    assert optimizer_state_bytes(None, 100, 8) == 0
    assert optimizer_state_bytes("exact_sgd", 100, 8) == 0
    assert optimizer_state_bytes("exact_row_wise_adagrad", 100, 8) == 400
    assert optimizer_state_bytes("ROWWISE_ADAGRAD", 100, 8) == 400  # enum name form
    assert optimizer_state_bytes("exact_adagrad", 100, 8) == 3200
    assert optimizer_state_bytes("adam", 100, 8) == 6400
    assert optimizer_state_bytes("partial_row_wise_adam", 100, 8) == 3600


def test_storage_by_hand_cpu_table_wise():
    table = TableMeta("t", 1000, 64, optimizer="exact_row_wise_adagrad")
    storage = EmbeddingStorageEstimator(Topology(2), batch_size=512).estimate(
        table, "table_wise", "fused", 1000, 64
    )
    ids_in = bags_out = 512 * 2
    expected = 1000 * 64 * 4 + 1000 * 4 + ids_in * 8 + 2 * bags_out * 64 * 4
    assert storage.hbm == 0 and storage.ddr == expected
    # a prefetching pipeline holds three batches of ids (TorchRec's factor)
    prefetched = EmbeddingStorageEstimator(
        Topology(2), 512, PipelineType.TRAIN_PREFETCH_SPARSE_DIST
    )
    assert prefetched.estimate(table, "table_wise", "fused", 1000, 64).ddr == (
        expected + 2 * ids_in * 8
    )


def test_storage_of_fp16_tables():
    """FP16 weights count 2 bytes each; the optimizer state stays fp32 and the pooled output
    fp32 (the kernels' output dtype)."""
    half = TableMeta("t", 1000, 64, optimizer="exact_adagrad", data_type=DataType.FP16)
    full = TableMeta("t", 1000, 64, optimizer="exact_adagrad")
    estimator = EmbeddingStorageEstimator(Topology(2), batch_size=512)
    fp16 = estimator.estimate(half, "table_wise", "fused", 1000, 64).ddr
    fp32 = estimator.estimate(full, "table_wise", "fused", 1000, 64).ddr
    assert fp32 - fp16 == 1000 * 64 * 2


def test_storage_placement_by_kernel_on_cuda():
    table = TableMeta("t", 1_000_000, 64, optimizer="adam")
    est = EmbeddingStorageEstimator(Topology(2, "cuda"), batch_size=128)
    fused = est.estimate(table, "table_wise", "fused", 1_000_000, 64)
    uvm = est.estimate(table, "table_wise", "fused_uvm", 1_000_000, 64)
    cached = est.estimate(
        table, "table_wise", "fused_uvm_caching", 1_000_000, 64, CacheParams(load_factor=0.1)
    )
    weights_and_state = 1_000_000 * 64 * (4 + 8)
    assert fused.ddr == 0 and fused.hbm > weights_and_state
    assert uvm.ddr == weights_and_state and uvm.hbm < 0.01 * fused.hbm
    assert cached.ddr == weights_and_state and uvm.hbm < cached.hbm < 0.2 * fused.hbm


def test_data_parallel_counts_gradient_and_replica():
    table = TableMeta("t", 1000, 16)
    est = EmbeddingStorageEstimator(Topology(4), batch_size=1)
    dp = est.estimate(table, "data_parallel", "dense", 1000, 16)
    assert dp.ddr >= 1000 * 16 * (4 + 2 * 4)


def test_perf_terms_move_the_right_way():
    topo = Topology(8, "cuda", local_world_size=4)
    est = EmbeddingPerfEstimator(topo, batch_size=512)
    table = TableMeta("t", 1_000_000, 128, pooling_factors=[10.0], optimizer="exact_adagrad")
    tw = est.estimate(table, "table_wise", "fused", 1_000_000, 128)
    assert tw.fwd_compute > 0 and tw.fwd_comms > 0 and tw.input_dist > 0 and tw.bwd_comms > 0
    assert tw.bwd_compute > tw.fwd_compute  # backward also writes rows and optimizer state
    uvm = est.estimate(table, "table_wise", "fused_uvm", 1_000_000, 128)
    assert uvm.fwd_compute > 10 * tw.fwd_compute
    dense = est.estimate(table, "table_wise", "dense", 1_000_000, 128)
    assert dense.bwd_compute > 10 * tw.bwd_compute  # full-table optimizer step
    half = est.estimate(table, "column_wise", "fused", 1_000_000, 64)
    assert half.fwd_comms == pytest.approx(tw.fwd_comms / 2)
    dp = est.estimate(table, "data_parallel", "dense", 1_000_000, 128)
    assert dp.fwd_comms == 0 and dp.input_dist == 0 and dp.bwd_comms > tw.bwd_comms
    rw = est.estimate(table, "row_wise", "fused", 125_000, 128)
    assert rw.fwd_compute < tw.fwd_compute  # 1/8 of the ids
    weighted = TableMeta("w", 1_000_000, 128, pooling_factors=[10.0], is_weighted=True)
    unweighted = TableMeta("u", 1_000_000, 128, pooling_factors=[10.0])
    assert (
        est.estimate(weighted, "table_wise", "fused", 1_000_000, 128).total
        > est.estimate(unweighted, "table_wise", "fused", 1_000_000, 128).total
    )


def test_inter_host_links_cost_more():
    table = TableMeta("t", 10_000, 64, pooling_factors=[4.0])
    one_host = EmbeddingPerfEstimator(Topology(8, "cuda"), 512)
    two_hosts = EmbeddingPerfEstimator(Topology(8, "cuda", local_world_size=4), 512)
    a = one_host.estimate(table, "table_wise", "fused", 10_000, 64)
    b = two_hosts.estimate(table, "table_wise", "fused", 10_000, 64)
    assert b.fwd_comms > a.fwd_comms and a.fwd_compute == b.fwd_compute


@pytest.mark.parametrize("rows, n", [(10, 4), (3, 4), (1000, 7), (8, 8), (1, 3)])
def test_runs_match_shard_geometry(rows, n):
    expanded = [size for count, size, _ in row_runs(rows, 4, n) for _ in range(count)]
    assert expanded == row_wise_sizes(rows, n)
    if n <= 40:
        widths = [c for count, _, c in column_runs(5, 40, n) for _ in range(count)]
        assert widths == column_wise_sizes(40, n)


def test_option_shards_expand_segments():
    topo = Topology(4)
    space = EmbeddingEnumerator(topo).enumerate_tables([TableMeta("t", 10, 40)])
    rw = next(o for o in space[0] if o.sharding_type == "row_wise")
    shards = rw.placed([0, 1, 2, 3]).shards
    assert [s.size for s in shards] == [[3, 40], [3, 40], [3, 40], [1, 40]]
    assert [s.offset[0] for s in shards] == [0, 3, 6, 9]
    assert [s.rank for s in shards] == [0, 1, 2, 3]
    assert rw.total_ddr == pytest.approx(sum(s.storage.ddr for s in shards))
