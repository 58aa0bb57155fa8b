"""DLRM training on 2 gloo ranks: the loss falls, every sharding type trains, Criteo data
flows, a resumed run continues exactly, and the CLI runs end to end through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from multiprocess import run_ranks

ROOT = Path(__file__).resolve().parents[2]
CRITEO_DIR = (ROOT / "../shared/data/criteo").resolve()
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
]


def _train_losses(rank: int, world_size: int, argv: List[str]) -> List[float]:
    from examples.dlrm.args import parse_args
    from examples.dlrm.data.loaders import train_batches
    from examples.dlrm.train import Runner, build_training, init_distributed

    args = parse_args(argv)
    _, _, local_size, device = init_distributed(60)
    dmp, optimizer, _, _ = build_training(args, device, world_size, local_size)
    runner = Runner(dmp, optimizer, device, args.pipeline, lambda _: None)
    batches = train_batches(args, rank, world_size, 0, None)
    losses = []
    for _ in range(args.steps):
        loss, _, _ = runner.step(batches)
        losses.append(float(loss))
    return losses


def test_loss_decreases_over_30_steps() -> None:
    argv = TINY + ["--steps", "30", "--batch-size", "128", "--lr", "0.1", "--sharding", "auto"]
    for losses in run_ranks(2, _train_losses, argv, timeout=180):
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.03, losses


def _run_many(rank: int, world_size: int, argvs: List[List[str]]) -> List[Dict[str, Any]]:
    from examples.dlrm.args import parse_args
    from examples.dlrm.train import run

    return [run(parse_args(argv)) for argv in argvs]


def test_every_sharding_and_kernel_trains(tmp_path: Path) -> None:
    base = TINY + ["--steps", "3", "--batch-size", "32", "--eval-batches", "2"]
    plan = str(tmp_path / "plan.json")
    argvs = [
        base + ["--sharding", s]
        for s in ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
    ]
    argvs += [
        base + ["--sharding", "row_wise", "--kernel", "dense", "--optimizer", "adagrad"],
        base
        + [
            "--sharding",
            "table_wise",
            "--interaction",
            "dcn",
            "--optimizer",
            "sgd",
            "--dcn-low-rank-dim",
            "4",
            "--multi-hot",
            "3",
        ],
    ]
    argvs += [
        base + ["--sharding", "table_wise", "--no-pipeline", "--eval-every", "2"],
        base + ["--sharding", "table_wise", "--eval-every", "2"],
    ]
    argvs += [base + ["--sharding", "column_wise", "--save-plan", plan], base + ["--plan", plan]]
    summaries = run_ranks(2, _run_many, argvs, timeout=240)
    saved, loaded = summaries[0][-2:]
    assert saved["final_eval"] == loaded["final_eval"]  # --plan ran the saved column-wise plan
    assert '"column_wise"' in Path(plan).read_text()
    plain, pipelined = summaries[0][-4:-2]
    assert plain["evals"] == pipelined["evals"]  # the pipeline changes timing, not numbers
    for rank_summaries in summaries:
        for summary in rank_summaries:
            assert summary["steps"] == 3 and summary["world_size"] == 2
            assert 0.0 <= summary["final_eval"]["auc"] <= 1.0
            assert summary["final_loss_ema"] == summary["final_loss_ema"]  # not NaN
    # eval metrics are synchronized over ranks: both report the same numbers
    assert all(a["final_eval"] == b["final_eval"] for a, b in zip(*summaries))


@pytest.mark.skipif(not CRITEO_DIR.is_dir(), reason="Criteo samples not on this machine")
def test_criteo_files_train_and_eval() -> None:
    argv = TINY + [
        "--data",
        "criteo",
        "--data-path",
        str(CRITEO_DIR),
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--num-workers",
        "0",
        "--eval-batches",
        "0",
    ]  # daemon ranks: no workers
    summaries = run_ranks(2, _run_many, [argv], timeout=180)
    first, second = (s[0] for s in summaries)
    # 3 files over 2 ranks: rank 0 gets 2 files, rank 1 one; both stop with the shorter one
    # rank 1 reads the 100-line file: 89 train lines -> 11 batches of 8; 11 eval lines -> 1
    assert first["steps"] == second["steps"] == 11
    assert first["final_eval"]["samples"] == second["final_eval"]["samples"] == 16


def _torchrun(args: List[str], tmp_path: Path) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "examples.dlrm.train",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_end_to_end(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.json"
    argv = TINY + [
        "--batch-size",
        "64",
        "--eval-batches",
        "2",
        "--sharding",
        "row_wise",
        "--steps",
        "4",
        "--metrics-json",
        str(metrics),
        "--comm-precision",
        "fp16",
        "--tp-over-arch",
    ]
    done = _torchrun(argv, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "t_cat_25" in done.stdout and "row_wise" in done.stdout  # the plan table
    assert "eval (final) @ step 4: auc" in done.stdout and "summary" in done.stdout
    record = json.loads(metrics.read_text())
    assert record["steps"] == 4 and record["world_size"] == 2 and record["pipeline"]
    assert record["plan"]["modules"]["model.sparse_arch.embedding_bag_collection"]


def test_resume_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    common = TINY + [
        "--batch-size",
        "32",
        "--eval-batches",
        "2",
        "--eval-every",
        "4",
        "--optimizer",
        "adagrad",
    ]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    argvs = [
        common + ["--steps", "6"],
        common + ckpt + ["--steps", "4"],
        common + ckpt + ["--steps", "6", "--resume"],
    ]
    straight, first, resumed = run_ranks(2, _run_many, argvs, timeout=180)[0]
    assert first["steps"] == 4 and resumed["steps_this_run"] == 2
    assert [e["step"] for e in resumed["evals"]] == [4, 6]
    for key in ("auc", "log_loss", "ne"):
        assert resumed["final_eval"][key] == pytest.approx(straight["final_eval"][key], abs=1e-5)


def test_help_documents_every_flag() -> None:
    from examples.dlrm.args import build_parser

    text = build_parser().format_help()
    for flag in (
        "--steps",
        "--epochs",
        "--batch-size",
        "--embedding-dim",
        "--num-embeddings-per-feature",
        "--dense-arch-layers",
        "--over-arch-layers",
        "--interaction",
        "--sharding",
        "--plan",
        "--kernel",
        "--optimizer",
        "--lr",
        "--pipeline",
        "--no-pipeline",
        "--data",
        "--data-path",
        "--eval-every",
        "--checkpoint-dir",
        "--resume",
        "--seed",
        "--metrics-json",
        "--demo",
        "--save-plan",
        "--eval-data-path",
        "--multi-hot",
    ):
        assert flag in text, flag
