"""Step-cost calibration (a real sharded module's per-group overhead and work scale, measured
on two ranks), the fused kernel's distinct-rows term, and data-parallel's row exchange in the
cost model."""

from __future__ import annotations

import math

import pytest

from recshard.calibration import CalibrationGrid, StepProbe, calibrate_job
from recshard.calibration.fitting import WorkSample, fit_work
from recshard.planner import EmbeddingPerfEstimator, TableMeta, Topology
from recshard.planner.cost.estimators import data_parallel_exchange
from recshard.planner.cost.step_model import StepTimePerfModel
from recshard.planner.profile import (
    STEP_TYPES,
    CalibrationProfile,
    KernelCost,
    LinkCost,
    StepCost,
    distinct_rows,
)
from recshard.sharding.data_parallel import ROW_EXCHANGE_MIN_BYTES
from tests.multiprocess import run_ranks


def _calibrate_job(rank, world_size):
    return calibrate_job(
        budget_s=1.0, grid=CalibrationGrid.quick(), probe=StepProbe.quick()
    ).to_dict()


@pytest.mark.slow  # 25-215 s on 2 busy cores: make test stays under 15 min
def test_job_calibration_on_two_ranks_measures_links_memory_and_step_costs():
    profiles = run_ranks(2, _calibrate_job, timeout=300)
    # one profile for the job: the ranks plan the same probe modules and the same plans
    assert {k: v for k, v in profiles[0].items() if k != "seconds"} == {
        k: v for k, v in profiles[1].items() if k != "seconds"
    }
    profile = CalibrationProfile.from_dict(profiles[0])
    assert {(c.sharding_type, c.phase) for c in profile.steps} == {
        (t, p) for t in STEP_TYPES for p in ("fwd", "bwd")
    }
    for cost in profile.steps:
        assert cost.ms_per_group >= 0 and cost.ms_per_feature >= 0
        assert cost.work_scale >= 0 and cost.ms_per_shard >= 0 and cost.ms_per_id >= 0
        assert cost.work_scale > 0 or cost.ms_per_shard > 0 or cost.ms_per_id > 0
    # a real module step costs something: forward + backward of one group is not free
    assert profile.step_ms("table_wise", 4) > 0
    model = StepTimePerfModel(Topology(2, profile=profile))
    assert model.group_ms("row_wise", "fused", 16, 4) == pytest.approx(
        profile.step_ms("row_wise", 4)
    )
    # the job's profile carries calibrate's links on both ranks and its fresh-process memory probe
    kinds = {(c.collective, c.level) for c in profile.links}
    assert kinds == {
        ("all_to_all", "intra"),
        ("reduce_scatter", "intra"),
        ("all_gather", "intra"),
        ("all_reduce", "intra"),
    }
    assert all(c.gbps > 0 and c.latency_ms >= 0 and c.ranks == 2 for c in profile.links)
    assert Topology(2, profile=profile).intra_host_bw == pytest.approx(profile.gbps("intra") * 1e6)
    memory = profile.memory
    assert memory is not None and memory.weight_factor >= 1.0
    assert memory.bytes_per_id >= 0 and memory.bytes_per_output_byte >= 0


@pytest.mark.slow  # ~35-80 s: make test stays under 15 min
def test_calibrate_job_on_one_process_measures_no_steps():
    profile = calibrate_job(budget_s=1.0, grid=CalibrationGrid.quick(), probe=StepProbe.quick())
    assert profile.world_size == 1 and profile.steps == []


def _sample(modelled, update, shards, ids, beyond):
    return WorkSample("table_wise", "bwd", modelled, shards, ids, beyond, update)


def test_fit_work_recovers_two_scales_a_cost_per_shard_and_per_id():
    assert fit_work(
        [_sample(m, 0.0, 24.0, 1e4, 1.7 * m) for m in (1.0, 5.0, 30.0)]
    ) == pytest.approx((1.7, 0.0, 0.0, 0.0))
    # the rest scaled by 2.1, the kernels' update by 1.3, plus 1.1 ms per shard and 2e-5 ms
    # per id, told apart by modules mixing them differently
    cases = [
        (7.0, 2.0, 8.0, 13e3),
        (30.0, 25.0, 24.0, 320e3),
        (82.0, 30.0, 24.0, 80e3),
        (95.0, 70.0, 24.0, 320e3),
        (20.0, 4.0, 8.0, 50e3),
        (60.0, 50.0, 8.0, 200e3),
    ]
    samples = [
        _sample(m, i, n, ids, 2.1 * (m - i) + 1.3 * i + 1.1 * n + 2e-5 * ids)
        for m, i, n, ids in cases
    ]
    assert fit_work(samples) == pytest.approx((2.1, 1.3, 1.1, 2e-5))
    assert fit_work([]) == (1.0, 1.0, 0.0, 0.0)  # nothing measured: nothing to scale


def _profile(steps):
    kernels = [
        KernelCost("fused", phase, 64, 1e-4, 0.0, 1e-6 if phase == "bwd" else 0.0, 0.1)
        for phase in ("fwd", "bwd")
    ]
    links = [
        LinkCost(c, "intra", 2, 2.0, 0.1) for c in ("all_to_all", "reduce_scatter", "all_gather")
    ]
    return CalibrationProfile("cpu", 1, 2, 2, kernels, links, steps=steps)


def test_measured_step_costs_drive_the_step_model_and_estimates():
    steps = [
        StepCost("table_wise", "fwd", 2.0, 0.1, work_scale=2.0, ms_per_shard=0.5, ms_per_id=1e-5),
        StepCost(
            "table_wise", "bwd", 1.0, 0.05, work_scale=3.0, ms_per_shard=0.25, element_scale=1.5
        ),
        StepCost("row_wise", "fwd", 4.0, 0.0),
        StepCost("row_wise", "bwd", 1.0, 0.0),
    ]
    model = StepTimePerfModel(Topology(2, profile=_profile(steps)))
    assert model.group_ms("table_wise", "fused", 64, 10) == pytest.approx(3.0 + 10 * 0.15)
    # a group's features add up over its tables; a second group pays its own fixed cost
    groups = [
        ("table_wise", "fused", 64, 4),
        ("table_wise", "fused", 64, 6),
        ("row_wise", "fused", 64, 1),
    ]
    assert model.fixed_ms(groups) == pytest.approx(3.0 + 10 * 0.15 + 5.0)
    # a type the profile did not measure falls back to its collectives' latencies
    assert model.group_ms("column_wise", "fused", 64, 1) == pytest.approx(
        5 * 0.1 + 2 * 0.1
    )  # 5 all-to-alls + the fused kernel's per-call fwd + bwd
    table = TableMeta("t", 50_000, 64, pooling_factors=[10.0])
    plain = EmbeddingPerfEstimator(Topology(2, profile=_profile([])), 512)
    scaled = EmbeddingPerfEstimator(Topology(2, profile=_profile(steps)), 512)
    a = plain.estimate(table, "table_wise", "fused", 50_000, 64)
    b = scaled.estimate(table, "table_wise", "fused", 50_000, 64)
    ids_in = 2 * 512 * 10  # table-wise: every rank's ids
    assert b.fwd_compute == pytest.approx(2 * a.fwd_compute + 0.5 + 1e-5 * ids_in)
    assert b.fwd_comms == pytest.approx(2 * a.fwd_comms)
    assert b.input_dist == pytest.approx(2 * a.input_dist)
    # backward: the kernel's update (1e-6 ms an element: distinct rows x dim) by 1.5, the
    # rest by 3
    update = distinct_rows(50_000, ids_in) * 64 * 1e-6
    assert b.bwd_compute == pytest.approx(3 * (a.bwd_compute - update) + 1.5 * update + 0.25)
    assert b.bwd_comms == pytest.approx(3 * a.bwd_comms)


def test_fused_update_is_priced_by_distinct_rows():
    assert distinct_rows(10, 1e6) == pytest.approx(10)  # every row, however many ids
    assert distinct_rows(1e7, 100) == pytest.approx(100, rel=1e-4)  # hardly any repeats
    est = EmbeddingPerfEstimator(Topology(2, profile=_profile([])), 512)
    ids = 2 * 512 * 10
    small = est.estimate(
        TableMeta("s", 20, 64, pooling_factors=[10.0]), "table_wise", "fused", 20, 64
    )
    large = est.estimate(
        TableMeta("l", 10_000_000, 64, pooling_factors=[10.0]),
        "table_wise",
        "fused",
        10_000_000,
        64,
    )
    assert small.bwd_compute == pytest.approx(ids * 1e-4 + distinct_rows(20, ids) * 64 * 1e-6)
    assert large.bwd_compute == pytest.approx(
        ids * 1e-4 + distinct_rows(10_000_000, ids) * 64 * 1e-6
    )
    assert small.bwd_compute < large.bwd_compute


def test_data_parallel_prices_the_rows_exchanged():
    small = TableMeta("s", 1_000, 16, pooling_factors=[4.0])
    assert 4 * 1_000 * 16 < ROW_EXCHANGE_MIN_BYTES
    assert data_parallel_exchange(small, 2, 512) == (4.0 * 1_000 * 16, 0)  # shared all-reduce
    big = TableMeta("b", 1_000_000, 64, pooling_factors=[4.0])
    used = 1_000_000 * -math.expm1(-2 * 512 * 4 / 1_000_000)
    assert data_parallel_exchange(big, 2, 512) == pytest.approx((1e6 + 4.0 * used * 64, 2))
    busy = TableMeta("h", 20_000, 64, pooling_factors=[20.0])  # most rows in use: all of it
    assert 4 * 20_000 * 64 >= ROW_EXCHANGE_MIN_BYTES
    assert data_parallel_exchange(busy, 2, 2048) == pytest.approx((20_000 + 4.0 * 20_000 * 64, 2))
    topo = Topology(2, profile=_profile([]))
    perf = EmbeddingPerfEstimator(topo, 512).estimate(big, "data_parallel", "dense", 1_000_000, 64)
    exchanged = 1e6 + 4.0 * used * 64
    ring = 0.5 / topo.intra_host_bw  # (W-1)/W per byte
    assert perf.bwd_comms == pytest.approx(2 * exchanged * ring + 2 * (0.1 + 0.1))
    # a profile that timed the backend's all-reduce (0.5 GB/s, 0.3 ms; the all-to-all 2 GB/s)
    # prices the exchange at that rate and latency, and a bandwidth flag still scales it
    timed = _profile([])
    timed.links.append(LinkCost("all_reduce", "intra", 2, 0.5, 0.3))
    perf = EmbeddingPerfEstimator(Topology(2, profile=timed), 512).estimate(
        big, "data_parallel", "dense", 1_000_000, 64
    )
    assert perf.bwd_comms == pytest.approx(exchanged * 0.5 / 0.5e6 + 2 * 0.3)
    slower = EmbeddingPerfEstimator(Topology(2, profile=timed, intra_host_bw=1.0), 512)
    assert slower.estimate(big, "data_parallel", "dense", 1_000_000, 64).bwd_comms == pytest.approx(
        exchanged * 0.5 / 0.25e6 + 2 * 0.3
    )


def test_table_column_wise_is_priced_with_column_wise_step_costs():
    # the probes do not build table-column-wise modules: its shards run as column-wise ones
    # (one placed group), so they take column-wise's measured costs instead of none at all
    steps = [
        StepCost("column_wise", "fwd", 2.0, 0.1, work_scale=2.0, ms_per_shard=0.5),
        StepCost("column_wise", "bwd", 1.0, 0.05, work_scale=3.0, element_scale=1.5),
    ]
    profile = _profile(steps)
    assert profile.step_ms("table_column_wise", 4) == pytest.approx(3.0 + 4 * 0.15)
    assert profile.work_scale("table_column_wise", "bwd") == 3.0
    assert profile.element_scale("table_column_wise", "bwd") == 1.5
    assert profile.shard_ms("table_column_wise", "fwd", 100.0) == 0.5
    assert _profile([]).step_ms("table_column_wise", 4) is None  # nothing measured: none
