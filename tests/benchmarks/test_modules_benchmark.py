"""`python -m benchmarks.modules --quick` runs end to end: one JSON line per module and
table set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_modules_benchmark_quick_covers_both_modules_and_table_sets() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.modules", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert {(r["module"], r["tables"]) for r in records} == {
        (m, t) for m in ("ebc", "ec") for t in ("small", "criteo_like")
    }
    assert all(r["api"] == "recshard" and r["median_step_ms"] > 0 for r in records)


@pytest.mark.slow  # ~35-80 s: make test stays under 15 min
def test_modules_benchmark_compare_alternates_sides_and_reports_ratios() -> None:
    """`--compare` with this interpreter as the other side (no other library needed)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.modules",
            "--quick",
            "--tables",
            "small",
            "--modules",
            "ebc",
            "--repeats",
            "2",
            "--compare",
            f"again={sys.executable}:recshard@{ROOT}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["side"] for r in records[:-1]] == ["recshard", "again", "recshard", "again"]
    summary = records[-1]
    assert summary["bench"] == "module_compare" and summary["tables"] == "small"
    assert summary["ratio_to_again"] == round(summary["recshard_ms"] / summary["again_ms"], 3)
