"""`python -m benchmarks.planner_accuracy --quick` runs end to end: a calibration, every
forced sharding type and the planner's plan per workload, JSON lines with predicted and
measured step time and memory, and the target check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.link import slowlink_missing

ROOT = Path(__file__).resolve().parents[2]
PLANS = {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "planner"}


@pytest.mark.slow
def test_planner_accuracy_quick(tmp_path) -> None:
    profile = tmp_path / "profile.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.planner_accuracy",
            "--quick",
            "--ids",
            "uniform",
            "--repeats",
            "3",
            "--save-profile",
            str(profile),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    runs = [r for r in records if r["bench"] == "planner_accuracy"]
    assert {r["plan"] for r in runs} == PLANS and {r["workload"] for r in runs} == {
        "d16_uniform_b64"
    }
    for r in runs:
        assert r["predicted_ms"] > 0 and r["measured_ms"] > 0 and r["memory_estimate_mb"] > 0
        assert r["rel_error"] == pytest.approx(
            abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"], rel=1e-3, abs=1e-3
        )
        # three fresh sets of ranks per plan; the median of their medians
        assert len(r["measured_repeats_ms"]) == 3
        assert r["measured_ms"] == pytest.approx(sorted(r["measured_repeats_ms"])[1], abs=1e-3)
    forced = {r["plan"]: r for r in runs}
    assert forced["data_parallel"]["sharding_types"] == {"data_parallel": 26}
    summary = records[-1]
    assert summary["bench"] == "planner_accuracy_summary" and summary["runs"] == len(PLANS)
    assert set(summary["met"]) == {
        "median_rel_error",
        "worst_rel_error",
        "planner_vs_fastest",
        "memory_rel_error",
    }
    assert json.loads(profile.read_text())["world_size"] == 2


@pytest.mark.slow
@pytest.mark.skipif(slowlink_missing() is not None, reason=f"slowlink: {slowlink_missing()}")
def test_planner_accuracy_link_check_on_one_rank_hosts(tmp_path) -> None:
    """Item 4's check at quick sizes: each rank its own host (table-row-wise plans for 1-rank
    hosts must build), a profile from the loopback, then a run on a 1gbit link beside it."""
    fast = tmp_path / "fast.json"
    common = ["--quick", "--ids", "uniform", "--local-world-size", "1"]
    first = _run(*common, "--save-profile", str(fast))
    assert first[-1]["bench"] == "planner_accuracy_summary" and first[-1]["link"] == "unshaped"
    records = _run(*common, "--link", "1gbit", "--link-check", str(fast))
    assert {r["link"] for r in records} == {"1gbit"}
    plans = {r["plan"] for r in records if r["bench"] == "planner_accuracy"}
    assert plans == PLANS | {f"planner@{fast}"}
    workload = next(r for r in records if r["bench"] == "planner_accuracy_workload")
    assert workload["link_check_vs_planner"] > 0


def _run(*argv: str) -> list:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.planner_accuracy", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_planner_accuracy_without_calibration() -> None:
    """`--no-calibration`: no calibration run, the plans planned and estimated with the
    built-in costs, and the planner-vs-fastest check made over the `--forced` plans run."""
    forced = ["table_wise", "column_wise"]
    records = _run("--quick", "--ids", "uniform", "--no-calibration", "--forced", ",".join(forced))
    setup = records[0]
    assert setup["bench"] == "planner_accuracy_setup" and setup["calibration_s"] is None
    assert setup["links"] == {}
    runs = [r for r in records if r["bench"] == "planner_accuracy"]
    assert {r["plan"] for r in runs} == {*forced, "planner"}
    assert all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in runs)
    summary = records[-1]
    assert summary["bench"] == "planner_accuracy_summary" and summary["planner_vs_fastest"] > 0


def test_no_calibration_refuses_a_profile() -> None:
    from benchmarks.planner_accuracy import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--no-calibration", "--profile", "p.json"])


def test_forced_plans_subset() -> None:
    from benchmarks.planner_accuracy import FORCED, parse_args

    assert parse_args([]).forced == FORCED
    assert parse_args(["--forced", "column_wise,table_wise"]).forced == [
        "column_wise",
        "table_wise",
    ]
    with pytest.raises(SystemExit):
        parse_args(["--forced", "table_wise,diagonal"])
