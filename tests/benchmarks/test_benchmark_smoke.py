"""`python -m benchmarks.ebc --quick` runs end to end and prints a JSON line per configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATIONS = {
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "data_parallel",
    "table_wise_dense",
}
STEP_FIELDS = {
    "name",
    "world_size",
    "batch",
    "steps",
    "median_step_ms",
    "samples_per_s",
    "step_ms_vs_table_wise",
    "samples_per_s_vs_table_wise",
}


@pytest.mark.slow
def test_ebc_benchmark_quick_covers_every_configuration() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.ebc", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # every stdout line is JSON (the profiler may log on stderr)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    by_bench: dict = {}
    for record in records:
        by_bench.setdefault(record["bench"], []).append(record)

    steps = {r["name"]: r for r in by_bench["ebc_step"]}
    assert set(steps) == CONFIGURATIONS
    for name, record in steps.items():
        assert STEP_FIELDS <= set(record), (name, record)
        assert record["world_size"] == 2 and record["median_step_ms"] > 0, record
        assert record["samples_per_s"] > 0, record
    assert steps["table_wise"]["samples_per_s_vs_table_wise"] == 1.0

    kernels = {r["name"] for r in by_bench["kernel"]}
    assert kernels == {
        "recshard_fused",
        "recshard_dense",
        "fbgemm_tbe_fused_exact_sgd",
        "nn_embeddingbag_torch_sgd",
    }
    ratios = {r["name"]: r["value"] for r in by_bench["kernel_ratio"]}
    assert "recshard_fused_speedup_vs_recshard_dense" in ratios and min(ratios.values()) > 0

    (profile,) = by_bench["profile"]
    assert profile["name"] == "table_wise" and len(profile["top_ops"]) == 10
    assert {"input_dist", "compute", "output_dist", "backward"} <= set(profile["phases_ms"])


@pytest.mark.slow  # 25-215 s on 2 busy cores: make test stays under 15 min
def test_shm_exchange_quick_trains_the_same_weights_both_ways() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.shm_exchange", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    runs = [r for r in records if r["bench"] == "shm_exchange_run"]
    assert {r["case"] for r in runs} == {"column_wise", "table_wise"}
    # the shared-memory exchange delivers the same bytes: the same weights after the steps
    assert all(r["same_weights"] for r in runs), runs
    summary = {r["case"]: r for r in records if r["bench"] == "shm_exchange"}
    assert set(summary) == {"column_wise", "table_wise"}
    assert all(r["gloo_step_ms"] > 0 and r["shm_step_ms"] > 0 for r in summary.values())
