"""The multi-rank harness itself: a rank that reports and then aborts at interpreter exit must
fail the call (the exit-time abort of issue #17 would otherwise pass unseen)."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
from multiprocess import RankError, run_ranks


def _abort_after_the_report_is_sent(*args: object, **kwargs: object) -> None:
    time.sleep(2.0)  # the queue's feeder thread sends the report first (else: "exited with -6")
    os.abort()


def _abort_at_exit_after(rank: int, ws: int, raise_first: bool) -> int:
    """Rank 1 arranges an abort (exit -6, as "terminate called without an active exception"
    gives) in the harness's teardown after it reported; with `raise_first` it also raises, like
    a handled error. (Multiprocessing children leave with os._exit, so atexit never runs.)"""
    if rank == 1:
        dist.destroy_process_group = _abort_after_the_report_is_sent
        if raise_first:
            raise ValueError("rank 1 rejected its input")
    return rank


@pytest.mark.parametrize("raise_first", [False, True], ids=["returned", "raised"])
def test_abort_at_exit_after_reporting_fails_the_call(raise_first: bool) -> None:
    with pytest.raises(RankError, match=r"exited with code -6") as info:
        run_ranks(2, _abort_at_exit_after, raise_first, timeout=60)
    if "at interpreter exit" in str(info.value) and raise_first:  # the report arrived
        assert "ValueError: rank 1 rejected its input" in str(info.value)


def _return_rank(rank: int, ws: int) -> int:
    return rank


def test_clean_ranks_return_their_results() -> None:
    assert run_ranks(2, _return_rank, timeout=60) == [0, 1]
