"""Elastic restarts on 2 simulated hosts: a killed rank costs time, never results.

The DLRM job checkpoints every few steps; one rank is SIGKILLed mid-run, `torchrun
--max-restarts` restarts the whole group, every rank resumes from the newest complete
checkpoint, and the final tables, dense weights, optimizer state, per-step losses and evals
equal those of an uninterrupted run with the same seed, bit for bit (CPU, gloo). A host whose
link goes down makes the others fail within the process-group timeout, naming the peer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from jobs import Job, children, torchrun

from recshard.checkpoint import read_checkpoint
from scripts.cluster import Cluster

pytestmark = pytest.mark.cluster

STEPS = 40
TRAIN = [
    "-m",
    "examples.dlrm.train",
    "--embedding-dim",
    "8",
    "--num-embeddings-per-feature",
    "500",
    "--dense-arch-layers",
    "16,8",
    "--over-arch-layers",
    "16,1",
    "--no-progress",
    "--batch-size",
    "32",
    "--eval-batches",
    "2",
    "--eval-every",
    "20",
    "--sharding",
    "table_row_wise",
    "--steps",
    str(STEPS),
    "--checkpoint-every",
    "4",
    "--pg-timeout",
    "60",
]


def _final_state(checkpoint_dir: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint, assembled whole (no process group needed) and
    checked as `recshard.checkpoint.load` checks it."""
    return read_checkpoint(str(checkpoint_dir))


def _extra(checkpoint_dir: Path) -> Dict:
    latest = checkpoint_dir / (checkpoint_dir / "LATEST").read_text().strip()
    return json.loads((latest / "extra.json").read_text())


def _checkpointed_step(checkpoint_dir: Path) -> int:
    try:
        return int(_extra(checkpoint_dir)["step"])
    except (OSError, ValueError, KeyError):  # none yet, or LATEST being replaced
        return 0


def _kill_one_rank_after(job: Job, checkpoint_dir: Path, step: int, timeout: float) -> int:
    """SIGKILL a worker of host1 once a checkpoint at `step` or later is committed; returns
    the step of that checkpoint."""
    deadline = time.monotonic() + timeout
    while (saved := _checkpointed_step(checkpoint_dir)) < step:
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.processes):
            job.kill()
            raise AssertionError(f"no checkpoint at step {step} in time\n{job.output()}")
        time.sleep(0.05)
    workers = [
        pid
        for pid in children(job.processes[1].pid)
        if "examples.dlrm.train" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
    assert workers, f"no worker under host1's torchrun\n{job.output()}"
    os.kill(workers[-1], signal.SIGKILL)
    return saved


@pytest.mark.slow  # ~45 s (two 4-rank jobs); test_dlrm_resume.py restarts in make test
def test_killed_rank_restarts_and_loses_nothing(cluster: Cluster, tmp_path: Path) -> None:
    # the straight run and the killed one run side by side (independent jobs, own ports)
    straight_dir = tmp_path / "straight" / "ckpt"
    straight = torchrun(
        cluster,
        TRAIN + ["--checkpoint-dir", str(straight_dir)],
        tmp_path / "straight",
        flags=["--max-restarts", "0"],
    )
    killed_dir = tmp_path / "killed" / "ckpt"
    killed = torchrun(
        cluster,
        TRAIN + ["--checkpoint-dir", str(killed_dir)],
        tmp_path / "killed",
        port=29501,
        flags=["--max-restarts", "2"],
    )
    try:
        saved = _kill_one_rank_after(killed, killed_dir, 8, timeout=120)
    except AssertionError:
        straight.kill()
        raise
    assert straight.wait(timeout=150) == [0, 0], straight.output()
    log = straight.output(0)
    assert "DLRM on 4 rank(s)" in log and f"eval (final) @ step {STEPS}" in log, log
    assert "250x8@0, 250x8@1" in log and "250x8@2, 250x8@3" in log, log  # TWRW within hosts

    assert killed.wait(timeout=150) == [0, 0], killed.output()
    log = killed.output(0)
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert resumed, log  # torchrun restarted the group and it found the checkpoint
    assert saved <= int(resumed.group(1)) < STEPS, log  # mid-run, at the kill's checkpoint or later

    assert _extra(killed_dir) == _extra(straight_dir)  # step, evals, every rank's losses
    assert len(_extra(killed_dir)["losses"][3]) == STEPS
    expected = _final_state(straight_dir)
    got = _final_state(killed_dir)
    assert got.keys() == expected.keys()
    assert any(k.startswith("fused_optim.") for k in got) and any(
        k.startswith("dense_optim.") for k in got
    )
    different: List[str] = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, different


@pytest.mark.slow  # ~30 s; tests/test_reliability.py's lost ranks run in make test
def test_unplugged_host_makes_the_others_fail_naming_it(cluster: Cluster, tmp_path: Path) -> None:
    train = [a if a != "60" else "15" for a in TRAIN]  # --pg-timeout 15
    train[train.index("--steps") + 1] = "100000"  # runs until the link goes down
    checkpoint_dir = tmp_path / "ckpt"
    job = torchrun(
        cluster,
        train + ["--checkpoint-dir", str(checkpoint_dir)],
        tmp_path,
        flags=["--max-restarts", "0"],
    )
    deadline = time.monotonic() + 120
    while _checkpointed_step(checkpoint_dir) < 4:  # training runs on both hosts
        assert time.monotonic() < deadline and job.processes[0].poll() is None, job.output()
        time.sleep(0.05)
    cluster.set_link(1, up=False)
    try:  # ends (an error, not a hang) after the 15 s process-group timeout and the probe
        code = job.processes[0].wait(timeout=120)
    finally:
        job.kill()
    log = job.output(0)
    assert code != 0, log
    for rank in (2, 3):
        assert re.search(
            rf"cannot reach .*rank {rank} on host1 \(10\.77\.0\.2:\d+\): no answer", log
        ), log
