"""`--managed-collision`: the DLRM trains on raw ids through a sharded MC-EBC under torchrun,
logs per-table evictions, rows in use and hit rate, and reads Criteo values as raw ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
from multiprocess import run_ranks
from test_dlrm_train import CRITEO_DIR, TINY, _torchrun

ZCH = 100
MC_PATH = "model.sparse_arch.embedding_bag_collection.managed_collision"


def test_cli_trains_and_logs_through_managed_collision(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.json"
    # synthetic ids come from 500 per feature into 100 rows: the tables fill and evict
    argv = TINY + [
        "--batch-size",
        "64",
        "--steps",
        "6",
        "--eval-batches",
        "2",
        "--sharding",
        "row_wise",
        "--managed-collision",
        str(ZCH),
        "--mc-eviction-interval",
        "2",
        "--mc-log-every",
        "3",
        "--metrics-json",
        str(metrics),
    ]
    done = _torchrun(argv, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "managed collision @ step 3:" in done.stdout, done.stdout
    assert "managed collision @ step 6:" in done.stdout
    assert "t_cat_0   evicted" in done.stdout and "hit rate" in done.stdout
    record = json.loads(metrics.read_text())
    assert MC_PATH in record["plan"]["modules"]
    tables: Dict[str, Dict[str, Any]] = record["managed_collision"]
    assert len(tables) == 26
    # one id per feature and sample (--multi-hot 1): every rank's lookups are summed
    assert all(t["lookups"] == 6 * 64 * 2 for t in tables.values()), tables
    assert sum(t["evicted"] for t in tables.values()) > 0
    assert all(0.0 <= t["hit_rate"] <= 1.0 for t in tables.values())
    assert any(0.0 < t["hit_rate"] < 1.0 for t in tables.values())


def _train(rank: int, world_size: int, argv: List[str]) -> Dict[str, Any]:
    from examples.dlrm.args import parse_args
    from examples.dlrm.train import run

    return run(parse_args(argv))


def test_raw_criteo_ids_preprocessed_and_trained(tmp_path: Path) -> None:
    sample = CRITEO_DIR / "pytorch-fm_fork_criteo_train_1000.txt"
    if not sample.exists():
        pytest.skip(f"Criteo sample {sample} is not on this machine")
    from examples.dlrm.data.binary import BinaryCriteo
    from examples.dlrm.preprocess import main as preprocess

    raw = tmp_path / "raw"
    preprocess(["--input", str(sample), "--output", str(raw), "--vocab", "raw", "--workers", "1"])
    expected = {
        0 if not value else int(value, 16) + 1
        for line in sample.read_text().splitlines()
        for value in line.split("\t")[14:40]
    }
    stored = set()
    for split in ("train", "eval"):
        for batch in BinaryCriteo(str(raw), 8, split, 0, 1):
            stored.update(batch.sparse_features.values().tolist())
    assert stored == expected and max(expected) > 2**31  # every raw 32-bit code, value + 1

    argv = TINY + ["--data", "criteo", "--data-path", str(raw), "--batch-size", "16"]
    argv += ["--eval-batches", "0", "--managed-collision", str(ZCH), "--mc-eviction-interval", "4"]
    for summary in run_ranks(2, _train, argv, timeout=180):
        assert summary["steps"] == 896 // 2 // 16  # the train split over 2 ranks
        assert sum(t["evicted"] for t in summary["managed_collision"].values()) > 0


def _run_many(rank: int, world_size: int, argvs: List[List[str]]) -> List[Dict[str, Any]]:
    return [_train(rank, world_size, argv) for argv in argvs]


def test_resumed_run_keeps_ids_in_their_rows(tmp_path: Path) -> None:
    """Stopped between evictions (step 3, interval 2) and resumed to 8: the same losses, eval
    and evictions as straight through, so the checkpoint kept every id's row, its eviction
    metadata, the ids counted since the last eviction and the schedule."""
    common = TINY + ["--batch-size", "32", "--eval-batches", "2", "--sharding", "row_wise"]
    common += ["--managed-collision", str(ZCH), "--mc-eviction-interval", "2"]
    common += ["--checkpoint-every", "3"]
    again = common + ["--checkpoint-dir", str(tmp_path / "stopped")]
    argvs = [
        common + ["--steps", "8", "--checkpoint-dir", str(tmp_path / "straight")],
        again + ["--steps", "3"],
        again + ["--steps", "8"],
    ]
    for full, first, resumed in run_ranks(2, _run_many, argvs, timeout=240):
        assert resumed["steps_this_run"] == 5 and resumed["losses"] == full["losses"]
        assert resumed["final_eval"] == full["final_eval"]
        for table, totals in full["managed_collision"].items():
            both = first["managed_collision"][table]["evicted"]
            both += resumed["managed_collision"][table]["evicted"]
            assert both == totals["evicted"], table


@pytest.mark.parametrize(
    "extra",
    [
        ["--managed-collision", "0"],
        ["--managed-collision", "10", "--sharding", "data_parallel"],
        ["--managed-collision", "10", "--position-weighted", "cat_0"],
        ["--managed-collision", "10", "--mc-eviction-interval", "0"],
    ],
)
def test_bad_managed_collision_flags_are_refused(extra: List[str]) -> None:
    from examples.dlrm.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + extra)
