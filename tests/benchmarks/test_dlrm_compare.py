"""`python -m benchmarks.dlrm_compare --no-torchrec --quick` trains recshard's side of the DLRM
comparison end to end (planner's plan through TrainPipelineSparseDist) and prints its JSON
lines; one case (FP16 tables, so the weights' dtype option runs too), to stay short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~14 s: a benchmark's run, not the library's
def test_dlrm_compare_quick_runs_recshard_side() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "RECSHARD_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.dlrm_compare", "--no-torchrec", "--quick"]
        + ["--plans", "planner", "--loops", "pipeline", "--data-types", "FP16"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    setup = [r for r in records if r["bench"] == "dlrm_compare_setup"]
    assert len(setup) == 1 and setup[0]["environment"] == {}, setup
    cases = {
        (r["plan"], r["loop"], r["data_type"]): r for r in records if r["bench"] == "dlrm_compare"
    }
    assert set(cases) == {("planner", "pipeline", "FP16")}
    for record in cases.values():
        assert record["recshard_step_ms"] > 0 and record["recshard_samples_per_s"] > 0, record
        assert record["recshard_peak_rss_mb"] > 0, record
        assert record["recshard_sharding_types"], record
        assert "ratio" not in record  # no TorchRec side was run


@pytest.mark.slow  # a benchmark's run, not the library's
def test_tbe_floor_quick_prints_every_piece() -> None:
    """`python -m benchmarks.tbe_floor --quick`: fbgemm's forward/backward for fp32 and fp16
    weights against their floors, and the torch pieces."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.tbe_floor", "--quick", "--steps", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    floors = {r["weights"]: r for r in records if r["bench"] == "tbe_floor"}
    assert set(floors) == {"FP32", "FP16"}
    for record in floors.values():
        assert record["fbgemm_backward_ms"] > 0 and record["update_floor_ms"] > 0, record
    assert floors["FP16"]["forward_floor_ms"] < floors["FP32"]["forward_floor_ms"]
    (pieces,) = [r for r in records if r["bench"] == "tbe_floor_torch_pieces"]
    assert pieces["distinct_rows"] > 0 and pieces["segment_sum_ms"] > 0, pieces
