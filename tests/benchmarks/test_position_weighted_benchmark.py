"""`python -m benchmarks.position_weighted --quick` runs end to end: one JSON line per case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 25-215 s on 2 busy cores: make test stays under 15 min
def test_position_weighted_benchmark_quick() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.position_weighted", "--quick", "--sharding", "row_wise"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [line["case"] for line in lines] == [
        "position_weighted",
        "weighted_ebc",
        "unweighted_ebc",
    ]
    assert all(line["median_ms"] > 0 and line["sharding"] == "row_wise" for line in lines)
