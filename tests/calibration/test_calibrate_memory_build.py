"""The calibrated build memory (issue #22, memory target): fused tables are built in place,
so building grows a process by their weights plus a fixed part, fitted over two sizes;
the profile's memory fields round-trip, and a profile written before the fit still loads,
with a warning naming what is off."""

from __future__ import annotations

import json
import logging

import pytest

from recshard.calibration import CalibrationGrid
from recshard.calibration.fitting import fit_build
from recshard.calibration.memory import measure_memory
from recshard.planner import EmbeddingShardingPlanner, TableMeta, Topology
from recshard.planner.cost.plan_stats import plan_stats
from recshard.planner.profile import CalibrationProfile, MemoryCost

MB = 1 << 20


def test_fit_build_recovers_factor_and_fixed_part():
    factor, fixed = fit_build([(50 * MB, 57 * MB), (100 * MB, 107 * MB), (200 * MB, 207 * MB)])
    assert factor == pytest.approx(1.0) and fixed == pytest.approx(7 * MB)
    factor, fixed = fit_build([(50 * MB, 80 * MB), (100 * MB, 140 * MB)])
    assert factor == pytest.approx(1.2) and fixed == pytest.approx(20 * MB)
    # a slope under 1 is noise (the weights are resident once built): floored at 1
    factor, fixed = fit_build([(50 * MB, 59 * MB), (100 * MB, 104 * MB)])
    assert factor == 1.0 and fixed == pytest.approx(6.5 * MB)
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_build([(50 * MB, 57 * MB), (50 * MB, 58 * MB)])


@pytest.mark.slow  # 25-215 s on 2 busy cores: make test stays under 15 min
def test_measured_build_is_the_weights_plus_a_fixed_part():
    """Real fresh-process probes (2 and 4 tables of 25 MB): no per-byte factor
    beyond the weights, and no table-sized transient; fbgemm's ~55 MB import is not counted
    (it was, as 1.27 x the weights of the default probe, before the two-size fit)."""
    grid = CalibrationGrid(dims=(64,), poolings=(1, 4), batches=(256,), rows=(100_000,), tables=4)
    measured = measure_memory(grid)
    assert measured is not None
    assert 1.0 <= measured.weight_factor < 1.05
    assert 0 <= measured.build_fixed_bytes < 32 * MB
    assert measured.bytes_per_id >= 0 and measured.bytes_per_output_byte >= 1.0


def test_memory_fields_round_trip(tmp_path):
    memory = MemoryCost(1.0, 21.7, 2.44, rank_overhead_bytes=8.3e6, build_fixed_bytes=7.3e6)
    profile = CalibrationProfile("cpu", 1, memory=memory, host="h")
    path = tmp_path / "p.json"
    profile.save(str(path))
    loaded = CalibrationProfile.load(str(path))
    assert loaded.memory == memory
    assert json.loads(path.read_text())["memory"]["build_fixed_bytes"] == 7.3e6


def test_profile_from_before_the_build_fit_loads_with_a_warning(tmp_path, caplog):
    old = CalibrationProfile("cpu", 1, memory=MemoryCost(1.27, 22.1, 1.5, 8.3e6), host="h")
    data = old.to_dict()
    del data["memory"]["build_fixed_bytes"]  # as written before the field existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="recshard.planner.profile"):
        loaded = CalibrationProfile.load(str(path))
    assert loaded.memory == MemoryCost(1.27, 22.1, 1.5, 8.3e6, build_fixed_bytes=0.0)
    assert "predate the two-size build fit" in caplog.text and "weight_factor 1.27" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recshard.planner.profile"):
        CalibrationProfile.from_dict(
            CalibrationProfile("cpu", 1, memory=MemoryCost(1.0, 0.0, 1.0)).to_dict()
        )
    assert caplog.text == ""  # a current profile: no warning


def test_unknown_memory_field_is_refused(tmp_path):
    data = CalibrationProfile("cpu", 1, memory=MemoryCost(1.0, 0.0, 1.0)).to_dict()
    data["memory"]["transient_bytes"] = 1.0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad.json: not a calibration profile.*transient_bytes"):
        CalibrationProfile.load(str(path))


def test_build_fixed_part_is_the_per_rank_fixed_growth_where_no_step_overhead_was_measured():
    tables = [TableMeta(f"t{i}", 1000, 16, pooling_factors=[2.0]) for i in range(3)]
    plan = EmbeddingShardingPlanner(Topology(2), 64, debug=False).plan_tables(tables)

    def rank_memory(memory: MemoryCost):
        topo = Topology(2, profile=CalibrationProfile("cpu", 1, memory=memory))
        return [r.memory for r in plan_stats(plan, tables, topo, 64).ranks]

    plain = rank_memory(MemoryCost(1.0, 0.0, 1.0))
    build_only = rank_memory(MemoryCost(1.0, 0.0, 1.0, build_fixed_bytes=5e6))
    both = rank_memory(MemoryCost(1.0, 0.0, 1.0, rank_overhead_bytes=9e6, build_fixed_bytes=5e6))
    assert build_only == pytest.approx([m + 5e6 for m in plain])
    # the sharded step's fixed growth includes its build's: counted once, not both
    assert both == pytest.approx([m + 9e6 for m in plain])
