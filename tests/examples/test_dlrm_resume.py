"""DLRM checkpoints on 2 gloo ranks: `--checkpoint-every`, automatic resume, exact losses.

A job stopped after 5 steps and started again with the same flags resumes by itself from
its newest checkpoint and ends with the per-step losses (every step's, both ranks) of a job
that ran straight through; `--no-resume` starts over. (Killing a rank under torchrun on two
hosts: tests/cluster/test_elastic.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from multiprocess import run_ranks

TINY = [
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
    "--sharding",
    "row_wise",
    "--checkpoint-every",
    "2",
]


def _run_many(rank: int, world_size: int, argvs: List[List[str]]) -> List[Dict[str, Any]]:
    from examples.dlrm.args import parse_args
    from examples.dlrm.train import run

    return [run(parse_args(argv)) for argv in argvs]


def test_restarted_job_resumes_by_itself_with_the_same_losses(tmp_path: Path) -> None:
    straight = TINY + ["--steps", "8", "--checkpoint-dir", str(tmp_path / "straight")]
    again = TINY + ["--checkpoint-dir", str(tmp_path / "stopped")]
    argvs = [
        straight,
        again + ["--steps", "5"],
        again + ["--steps", "8"],
        again + ["--steps", "8", "--no-resume"],
    ]
    for full, first, resumed, over in run_ranks(2, _run_many, argvs, timeout=240):
        assert len(full["losses"]) == 8 and first["steps"] == 5
        assert resumed["steps_this_run"] == 3 and resumed["losses"] == full["losses"]
        assert over["steps_this_run"] == 8 and over["losses"] == full["losses"]
        assert resumed["final_eval"] == full["final_eval"]


def _rng_round_trip(rank: int, world_size: int, directory: str) -> List[List[float]]:
    import torch

    from examples.dlrm.args import parse_args
    from examples.dlrm.checkpointing import Progress, resume, save_progress
    from examples.dlrm.train import build_training

    args = parse_args(TINY + ["--checkpoint-dir", directory])
    device = torch.device("cpu")
    dmp, optimizer, _, _ = build_training(args, device, world_size, world_size)
    torch.manual_seed(100 + rank)  # each rank's own stream
    save_progress(directory, dmp, optimizer, Progress(3, [], [0.5, 0.25, 0.125]), device)
    after_save = torch.rand(4).tolist()
    progress = resume(directory, dmp, optimizer, device, lambda _: None)
    assert progress is not None and progress.step == 3
    assert progress.losses == [0.5, 0.25, 0.125]
    return [after_save, torch.rand(4).tolist()]


def test_resume_restores_each_ranks_rng_state(tmp_path: Path) -> None:
    (first, again), (other, _) = run_ranks(2, _rng_round_trip, str(tmp_path / "ckpt"), timeout=120)
    assert first == again  # the stream continues from where the checkpoint was taken
    assert first != other  # rank 1 got its own state back, not rank 0's
