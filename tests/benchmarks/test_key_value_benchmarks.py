"""The key-value benchmarks run end to end at a tiny size: `benchmarks.key_value` (one process,
every tier) and `benchmarks.key_value_large` (2 ranks), one JSON line per tier, files removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str) -> list:
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_key_value_benchmark_runs_small(tmp_path) -> None:
    lines = _run(
        "benchmarks.key_value",
        *("--rows", "4000", "--batch", "64", "--steps", "2", "--warmup", "3"),
        *("--directory", str(tmp_path)),
    )
    assert [line["tier"] for line in lines] == [
        "in_memory",
        "in_memory_native",
        "row_cache",
        "row_cache_prefetch",
        "page_cache",
    ]
    for line in lines[2:4]:
        assert 0.0 <= line["hit_rate"] <= 1.0 and line["step_ms"] > 0


@pytest.mark.slow  # two 2-rank jobs: tens of seconds on 2 busy cores
def test_key_value_large_benchmark_runs_small(tmp_path) -> None:
    lines = _run(
        "benchmarks.key_value_large",
        *("--gib", "0.01", "--fused-gib", "0.01", "--batch", "64", "--warmup", "2"),
        *("--steps", "2", "--directory", str(tmp_path)),
    )
    assert [line["kind"] for line in lines] == ["key_value", "fused"]
    assert all(len(line["per_rank"]) == 2 and line["samples_per_s"] > 0 for line in lines)
    assert "hit_rate" in lines[0]["per_rank"][0] and os.listdir(tmp_path) == []
