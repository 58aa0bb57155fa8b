"""Benchmarks on a shaped link (`benchmarks/link.py`): `--link RATE` re-runs a benchmark under
slowlink and every JSON line says which link it ran on; the collective wait clock attributes
waits to the input dist, the pooled forward and the backward.

Runs that need slowlink (root, `unshare`, `tc`) skip with the reason where it cannot run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch.distributed as dist
from multiprocess import run_ranks

import recshard.comm.kjt as kjt_a2a
import recshard.comm.request as request
from benchmarks.ebc import QUICK, build, criteo_tables, make_batches, pooling_factors, train_step
from benchmarks.link import CollectiveWaitClock, WaitTimes, relaunch_under_link, slowlink_missing

ROOT = Path(__file__).resolve().parents[2]
MISSING = slowlink_missing()
needs_slowlink = pytest.mark.skipif(MISSING is not None, reason=f"slowlink cannot run: {MISSING}")


def _records(*argv: str, timeout: float) -> List[Dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "loopback shaped to" in proc.stderr, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_link_rejects_a_rate_tc_would_not_take() -> None:
    with pytest.raises(SystemExit, match="expected a tc rate"):
        relaunch_under_link("benchmarks.pipeline", "1 gigabit", [])


def test_no_link_runs_in_place() -> None:
    assert relaunch_under_link("benchmarks.pipeline", None, []) is False


def _clocked_step(rank: int, world_size: int) -> Tuple[List[WaitTimes], bool]:
    """Table-wise EBC steps of the ebc benchmark under the clock: one step's waits, then a
    forward alone; and whether `close` gave the library its own `wait_work` back."""
    original = request.wait_work
    tables = criteo_tables(QUICK)
    pooling = pooling_factors(len(tables), QUICK.max_pooling)
    kjt = make_batches(tables, pooling, QUICK.batch, seed=rank, count=1)[0]
    trainee = build("table_wise", tables, pooling, QUICK.batch, None)
    clock = CollectiveWaitClock()
    train_step(trainee, kjt)
    step = clock.take()
    trainee.module(kjt).values()  # the output dist is waited when the result is read
    forward = clock.take()
    clock.close()
    dist.barrier()
    restored = request.wait_work is original and kjt_a2a.wait_work is original
    return [step, forward], restored


def test_wait_clock_attributes_input_dist_forward_and_backward_waits() -> None:
    for (step, forward), restored in run_ranks(2, _clocked_step):
        assert restored
        assert step.kjt > 0 and step.pooled_forward > 0 and step.backward > 0, step
        assert forward.kjt > 0 and forward.pooled_forward > 0 and forward.backward == 0, forward
        assert step.shares(step.total)["total"] == 1.0


@pytest.mark.slow  # ~40 s; the unshaped run below covers the report in make test
@needs_slowlink
def test_ebc_benchmark_under_a_shaped_link_reports_codecs_and_wait_shares() -> None:
    records = _records(
        "benchmarks.ebc",
        "--quick",
        "--no-kernels",
        "--link",
        "1gbit",
        "--types",
        "table_wise,table_wise_fp16,table_wise_bf16",
        timeout=300,
    )
    assert records and all(r["link"] == "1gbit" for r in records)
    steps = {r["name"]: r for r in records if r["bench"] == "ebc_step"}
    assert set(steps) == {"table_wise", "table_wise_fp16", "table_wise_bf16"}
    for record in steps.values():
        shares = record["wait_share"]
        assert set(shares) == {"kjt", "pooled_forward", "backward", "total"}
        assert 0 < shares["total"] <= 1, record


def test_ebc_benchmark_without_a_link_says_unshaped() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.ebc",
            "--quick",
            "--no-kernels",
            "--types",
            "table_wise",
            "--profile",
            "table_wise",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert records and all(r["link"] == "unshaped" for r in records)


@pytest.mark.slow
@needs_slowlink
def test_pipeline_benchmark_under_a_shaped_link_keeps_losses_identical() -> None:
    records = _records(
        "benchmarks.pipeline", "--quick", "--blocks", "1", "--link", "1gbit", timeout=600
    )
    (result,) = [r for r in records if r["bench"] == "train_pipeline"]
    assert result["link"] == "1gbit" and result["features"] == 26
    assert result["losses_identical"] and result["steps_compared"] > 0, result
    assert result["plain_wait_share"]["kjt"] > 0 and result["plain_samples_per_s"] > 0, result


@pytest.mark.slow
@needs_slowlink
def test_dlrm_benchmark_under_a_shaped_link() -> None:
    records = _records(
        "benchmarks.dlrm",
        "--link",
        "2gbit",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--kernels",
        "fused",
        timeout=600,
    )
    assert {(r["loop"], r["link"]) for r in records} == {("pipeline", "2gbit"), ("plain", "2gbit")}
    assert all(r["wait_share"]["total"] > 0 for r in records), records
