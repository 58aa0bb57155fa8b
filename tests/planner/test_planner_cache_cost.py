"""The fused CPU kernel's per-id cost rises once a table outgrows the last-level cache share
(`lookup_cost_scale`), read from sysfs or carried by a calibration profile, and the
table-wise placement balances ranks by that time rather than by ids."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from recshard.planner import EmbeddingPerfEstimator, EmbeddingShardingPlanner, TableMeta, Topology
from recshard.planner.calibrate import CalibrationGrid, measure_cache
from recshard.planner.estimators import (
    DEFAULT_MISS_RATIOS,
    cache_miss_fraction,
    lookup_cost_scale,
)
from recshard.planner.profile import (
    CacheCost,
    CalibrationProfile,
    KernelCost,
    machine_cache_bytes,
)

MIB = 2**20
BATCH = 512


def _cache_dir(root: Path, index: int, level: int, kind: str, size: str, shared: str) -> None:
    d = root / "cpu0" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, text in (("level", str(level)), ("type", kind), ("size", size),
                       ("shared_cpu_list", shared)):
        (d / name).write_text(text + "\n")


def test_machine_cache_is_the_last_level_share_per_core(tmp_path):
    _cache_dir(tmp_path, 0, 1, "Data", "48K", "0")
    _cache_dir(tmp_path, 1, 1, "Instruction", "32K", "0")
    _cache_dir(tmp_path, 2, 2, "Unified", "1024K", "0")
    _cache_dir(tmp_path, 3, 3, "Unified", "32768K", "0-3,8-11")
    assert machine_cache_bytes(sysfs=tmp_path) == 32 * MIB / 8
    assert machine_cache_bytes(sysfs=tmp_path / "absent") == 0.0


def test_cost_scale_rises_with_the_table_past_the_cache():
    assert lookup_cost_scale(16 * 1024, 16 * MIB, 4.0) == pytest.approx(1.0, abs=0.01)
    assert cache_miss_fraction(16 * MIB, 16 * MIB) == pytest.approx(0.5)
    assert cache_miss_fraction(48 * MIB, 16 * MIB) == pytest.approx(0.75)
    assert lookup_cost_scale(48 * MIB, 16 * MIB, 4.0) == pytest.approx(1 + 3 * 0.75)
    assert lookup_cost_scale(64 * MIB, 0.0, 4.0) == 1.0  # no cache model


def _per_id_ms(estimator: EmbeddingPerfEstimator, rows: int, phase: str) -> float:
    table = TableMeta("t", rows, 64, pooling_factors=[10.0])
    perf = estimator.estimate(table, "table_wise", "fused", rows, 64)
    return (perf.fwd_compute if phase == "fwd" else perf.bwd_compute) / (BATCH * 10 * 2)


def test_large_table_costs_more_per_id_without_profile():
    cached = EmbeddingPerfEstimator(Topology(2, cache_bytes=16 * MIB), BATCH)
    flat = EmbeddingPerfEstimator(Topology(2, cache_bytes=0.0), BATCH)
    tiny, small, large = 10, 10_000, 1_000_000  # 2.5 KiB, 2.4 MiB, 244 MiB of dim-64 rows
    assert _per_id_ms(cached, tiny, "bwd") == pytest.approx(_per_id_ms(flat, tiny, "bwd"),
                                                            rel=0.01)
    assert _per_id_ms(flat, small, "bwd") < _per_id_ms(cached, small, "bwd") < _per_id_ms(
        cached, large, "bwd")
    # each id's row read + write (2 x 256 B) costs the default miss ratio's scale at that size
    scale = lookup_cost_scale(large * 256, 16 * MIB, DEFAULT_MISS_RATIOS[1])
    assert _per_id_ms(cached, large, "bwd") - _per_id_ms(flat, large, "bwd") == pytest.approx(
        2 * 256 * (scale - 1) / flat.topology.ddr_mem_bw)
    assert _per_id_ms(cached, large, "fwd") > _per_id_ms(flat, large, "fwd")
    assert _per_id_ms(flat, large, "bwd") == pytest.approx(_per_id_ms(flat, small, "bwd"))
    # GPU kernels keep their bandwidth model
    gpu = EmbeddingPerfEstimator(Topology(2, "cuda"), BATCH)
    assert gpu.topology.cache_bytes == 0.0


def _profile(cache: CacheCost | None) -> CalibrationProfile:
    kernels = [KernelCost("fused", phase, 64, 1e-5, 0.0) for phase in ("fwd", "bwd")]
    return CalibrationProfile("cpu", 1, kernels=kernels, cache=cache)


def test_profile_carries_the_measured_ratio():
    cache = CacheCost(4 * MIB, 1.5, 5.0)
    with_cache = EmbeddingPerfEstimator(Topology(2, profile=_profile(cache)), BATCH)
    assert with_cache.topology.cache_bytes == 4 * MIB  # the profile's cache size
    miss = cache_miss_fraction(1_000_000 * 256, 4 * MIB)
    assert _per_id_ms(with_cache, 1_000_000, "bwd") == pytest.approx(1e-5 * (1 + 4 * miss))
    assert _per_id_ms(with_cache, 10, "bwd") == pytest.approx(1e-5, rel=0.01)
    # an older profile without a cache cost: its fits already average over sizes
    old = EmbeddingPerfEstimator(Topology(2, profile=_profile(None), cache_bytes=4 * MIB), BATCH)
    assert _per_id_ms(old, 1_000_000, "bwd") == pytest.approx(1e-5)
    profile = _profile(cache)
    assert CalibrationProfile.from_dict(profile.to_dict()) == profile


def test_calibrate_measures_miss_ratios():
    cache = measure_cache(CalibrationGrid.quick(), 2 * MIB, 0.05)
    assert cache is not None and cache.cache_bytes == 2 * MIB
    assert cache.fwd_miss_ratio >= 1.0 and cache.bwd_miss_ratio >= 1.0
    assert measure_cache(CalibrationGrid.quick(), 0.0, 0.05) is None


def _placement(topology: Topology, tables: list) -> dict:
    planner = EmbeddingShardingPlanner(topology, BATCH, debug=False)
    plan = planner.plan_tables(tables).plan[""]
    assert {p.sharding_type for p in plan.values()} == {"table_wise"}
    return {name: p.ranks[0] for name, p in plan.items()}


def test_table_wise_balances_ranks_by_time():
    """Three 1 M-row tables (cold) with 12 ids per bag, nine 1 k-row ones with 4: without a
    cache model the ranks split 36 / 36 ids; with it, the rank holding two big tables holds
    fewer ids, since their ids cost more."""
    big = [TableMeta(f"big{i}", 1_000_000, 64, pooling_factors=[12.0],
                     sharding_types=["table_wise"]) for i in range(3)]
    small = [TableMeta(f"small{i}", 1_000, 64, pooling_factors=[4.0],
                       sharding_types=["table_wise"]) for i in range(9)]
    tables = big + small
    pooling = {t.name: t.pooling_factors[0] for t in tables}

    def ids_per_rank(placement: dict) -> Counter:
        return Counter({r: sum(pooling[n] for n, rr in placement.items() if rr == r)
                        for r in (0, 1)})

    flat = ids_per_rank(_placement(Topology(2, cache_bytes=0.0), tables))
    assert flat[0] == flat[1] == 36  # ids balance exactly
    placement = _placement(Topology(2, cache_bytes=16 * MIB), tables)
    two_big = Counter(placement[t.name] for t in big).most_common(1)[0][0]
    ids = ids_per_rank(placement)
    assert ids[two_big] < ids[1 - two_big] - 4  # more than one small table fewer
