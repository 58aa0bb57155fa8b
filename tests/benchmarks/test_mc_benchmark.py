"""`python -m benchmarks.mc` runs end to end on 2 ranks and prints one JSON line per id
distribution, with evictions on the Zipf one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 25-215 s on 2 busy cores: make test stays under 15 min
def test_mc_benchmark_runs_small() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.mc",
            "--rows",
            "64",
            "--batch",
            "16",
            "--steps",
            "4",
            "--interval",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [line["ids"] for line in lines] == ["uniform", "zipf"]
    for line in lines:
        assert (
            line["plain_ebc_step_ms"] > 0
            and line["mc_step_ms"] > 0
            and line["mc_evicting_step_ms"] > 0
            and line["plain_ebc_step_cpu_ms"] > 0
            and line["mc_step_cpu_ms"] > 0
            and line["mc_evicting_step_cpu_ms"] > 0
            and line["mc_mean_step_ms"] > 0
            and line["mc_mean_step_cpu_ms"] > 0
        )
        assert 0 < line["remap_share_of_mc_step"] < 1
    assert lines[1]["evicted_rank0"] > 0
