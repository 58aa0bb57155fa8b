"""`python -m benchmarks.data` runs end to end (tiny sizes) and prints every stage as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "../shared/data/criteo").is_dir(), reason="no Criteo samples")
def test_data_benchmark_reports_every_stage() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.data",
            "--rows",
            "6000",
            "--tsv-rows",
            "2048",
            "--repeats",
            "1",
            "--train-steps",
            "2",
            "--warmup",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = {r["stage"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(records) == {"tsv", "preprocess", "binary", "train", "summary"}
    for stage in ("tsv", "preprocess", "binary"):
        assert records[stage]["rows_per_s"] > 0
    assert records["train"]["samples_per_s"] > 0 and records["train"]["world_size"] == 2
    assert records["summary"]["binary_over_train"] > 0
