"""The multi-rank harness itself: results in rank order, errors with tracebacks, no hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from multiprocess import RankError, run_ranks


def _all_reduce_rank(rank: int, world_size: int, scale: int) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item() * scale, "local": os.environ.get("LOCAL_WORLD_SIZE")}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order(world_size: int) -> None:
    results = run_ranks(world_size, _all_reduce_rank, 2, env={"LOCAL_WORLD_SIZE": "1"})
    expected_sum = 2.0 * sum(range(world_size))
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["sum"] == expected_sum and r["local"] == "1" for r in results)


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("table 't3' has a bad id 42")
    dist.barrier()


def test_error_carries_traceback() -> None:
    with pytest.raises(RankError, match="(?s)rank 1 failed:.*table 't3' has a bad id 42"):
        run_ranks(2, _raise_on_rank_one, timeout=60, pg_timeout_s=5)


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


@pytest.mark.slow  # ~13 s: the harness's own timeout, not the library's
def test_stuck_rank_is_killed() -> None:
    # a rank sleeping for an hour: the call returns (with this error) only because the
    # harness kills it at the timeout
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3s"):
        run_ranks(2, _sleep_forever, timeout=3)
