"""Key-value tables' bad input fails on every rank, never on one rank alone (2 real processes):
a batch whose rows do not fit one rank's DRAM cache (raised in the step, before the output
dist), and before training a storage directory that is not writable or that holds another
shape's files of a table. The model recovers from the rejected batch: the next one trains."""

from __future__ import annotations

import os
import tempfile
from typing import List, Tuple

import torch
from kv_cases import ROWS, build, make_batch
from multiprocess import run_ranks

from recshard import KeyedJaggedTensor


def _overflowing(step: int, rank: int):  # noqa: ANN202 - a pipeline_cases.Batch
    """Rank 0's batch reads 300 distinct rows of t0 (whose cache, on rank 1, holds 120)."""
    batch = make_batch(step, rank)
    if rank != 0:
        return batch
    features = batch.sparse_features.to_dict()
    values = [torch.arange(300), features["f1"].values(), features["f2"].values()]
    lengths = [torch.tensor([50] * 6), features["f1"].lengths(), features["f2"].lengths()]
    batch.sparse_features = KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1", "f2"], torch.cat(values), torch.cat(lengths)
    )
    return batch


def cache_overflow(rank: int, ws: int, base: str) -> Tuple[str, str, float]:
    model = build("key_value", ws, tempfile.mkdtemp(prefix=f"{rank}-", dir=base))
    outcome = ("no error", "")
    try:
        model(_overflowing(0, rank))
    except (ValueError, RuntimeError) as e:
        outcome = (type(e).__name__, str(e))
    loss, _ = model(make_batch(1, rank))  # the next batch trains on every rank
    loss.backward()
    return (*outcome, float(loss.detach()))


def test_cache_overflow_fails_on_every_rank(tmp_path) -> None:  # noqa: ANN001
    assert ROWS[0] * 0.1 < 300
    (kind0, message0, loss0), (kind1, message1, loss1) = run_ranks(
        2, cache_overflow, str(tmp_path), timeout=120
    )
    assert kind1 == "ValueError" and "table 't0'" in message1, message1
    assert "raise cache_load_factor" in message1 and "rows not cached" in message1, message1
    assert kind0 == "RuntimeError" and message0.startswith("rank 1 rejected its input: "), message0
    assert "table 't0'" in message0
    assert torch.isfinite(torch.tensor([loss0, loss1])).all()


def bad_directory(rank: int, ws: int, directories: List[str]) -> str:
    try:
        build("key_value", ws, directories[rank])
    except ValueError as e:
        return str(e)
    return "no error"


def test_unwritable_directory_fails_on_every_rank(tmp_path) -> None:  # noqa: ANN001
    """`/sys` passes `os.access` for root yet refuses new files: the check makes one."""
    for message in run_ranks(2, bad_directory, [str(tmp_path), "/sys"]):
        assert message.startswith("rank 1: ") and "'/sys' is not writable" in message, message
    assert os.listdir(tmp_path) == []


def _one_rank_run(rank: int, ws: int, directory: str) -> None:
    build("key_value", ws, directory)


def test_files_of_another_shape_fail_on_every_rank(tmp_path) -> None:  # noqa: ANN001
    """Rank 0's directory holds a 1-rank run's files (t1 800 rows, t2 6 columns); at 2 ranks
    rank 0 holds t1's rows 0-399 and t2's columns 0-2."""
    old, fresh = str(tmp_path / "old"), str(tmp_path / "fresh")
    os.mkdir(old), os.mkdir(fresh)
    run_ranks(1, _one_rank_run, old)
    for message in run_ranks(2, bad_directory, [old, fresh]):
        assert message.startswith("rank 0: table 't1'") and "another shape" in message, message
        assert "rows 800 x cols 3" in message, message
    assert os.listdir(fresh) == []
