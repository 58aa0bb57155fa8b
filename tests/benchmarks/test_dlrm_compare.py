"""`python -m benchmarks.dlrm_compare --no-torchrec --quick` trains recshard's side of the DLRM
comparison end to end (planner's plan through TrainPipelineSparseDist) and prints its JSON
lines; one case, to stay short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dlrm_compare_quick_runs_recshard_side() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "RECSHARD_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.dlrm_compare", "--no-torchrec", "--quick"]
        + ["--plans", "planner", "--loops", "pipeline"],
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
    cases = {(r["plan"], r["loop"]): r for r in records if r["bench"] == "dlrm_compare"}
    assert set(cases) == {("planner", "pipeline")}
    for record in cases.values():
        assert record["recshard_step_ms"] > 0 and record["recshard_samples_per_s"] > 0, record
        assert record["recshard_peak_rss_mb"] > 0, record
        assert record["recshard_sharding_types"], record
        assert "ratio" not in record  # no TorchRec side was run
