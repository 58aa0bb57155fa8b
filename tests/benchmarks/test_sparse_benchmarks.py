"""`python -m benchmarks.position_weighted --quick` and `benchmarks.vbe --quick` run end to end
(recshard's side; the shared loop of benchmarks/sparse_workloads.py): a summary line per case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 25-215 s on 2 busy cores: make test stays under 15 min
@pytest.mark.parametrize(
    "bench, cases",
    [
        ("position_weighted", ["position_weighted", "weighted_ebc", "unweighted_ebc"]),
        ("vbe", ["vbe", "expanded"]),
    ],
)
def test_sparse_benchmark_quick(bench: str, cases: List[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{bench}", "--quick", "--sharding", "row_wise"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert lines[0]["bench"] == f"{bench}_setup" and lines[0]["sharding"] == "row_wise"
    summary = [line for line in lines if line["bench"] == bench]
    assert [line["case"] for line in summary] == cases
    assert all(line["recshard_median_ms"] > 0 for line in summary)
    assert all("torchrec_median_ms" not in line for line in summary)
