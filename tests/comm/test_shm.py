"""The shared-memory all-to-all (recshard.comm.shm) across real processes, against gloo.

Each rank runs the same all-to-all-v calls twice: on a group that goes through gloo (made
with `RECSHARD_SHM_ALL_TO_ALL=0`) and on one that goes through /dev/shm; the bytes must be
equal. Splits are uneven with zeros, sizes grow between calls (new segment generations), and
more calls of one site are in flight than there are slots. A peer that never arrives gives a
`CollectiveError` naming it; nothing is left in /dev/shm afterwards.
"""

from __future__ import annotations

import glob
import os
import time
from typing import List, Tuple

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from recshard.comm import shm
from recshard.comm.errors import CollectiveError
from recshard.comm.request import issue_all_to_all


def _splits(src: int, dst: int, call: int, k: int) -> int:
    """Elements rank `src` sends rank `dst` in call `call` (`k`-th in flight): uneven, some
    zero, growing with `call` (up to 6 MB a chunk)."""
    return ((src + 2 * dst + call + k) % 4) * (1 << (6 + 3 * call))


def _calls(rank: int, ws: int, pg: dist.ProcessGroup, in_flight: int) -> List[torch.Tensor]:
    """Five calls of each of two sites (float32 and int64); `in_flight` issued before waits."""
    out: List[torch.Tensor] = []
    for call in range(5):
        pendings = []
        for site, dtype in (
            ("alltoall_pooled", torch.float32),
            ("kjt_all_to_all_values", torch.int64),
        ):
            for k in range(in_flight):
                ins = [_splits(rank, d, call, k) for d in range(ws)]
                outs = [_splits(s, rank, call, k) for s in range(ws)]
                g = torch.Generator().manual_seed(1000 * rank + 10 * call + k)
                x = torch.randint(-(2**40), 2**40, (sum(ins),), generator=g).to(dtype)
                pendings.append(issue_all_to_all(x, ins, outs, pg, name=site))
        out.extend(p.wait().clone() for p in pendings)
    return out


def _compare(rank: int, ws: int, in_flight: int) -> Tuple[bool, bool, bool, str]:
    os.environ[shm.ENV] = "0"
    gloo_pg = dist.new_group(list(range(ws)), backend="gloo")
    expected = _calls(rank, ws, gloo_pg, in_flight)
    os.environ[shm.ENV] = "1"
    got = _calls(rank, ws, dist.group.WORLD, in_flight)
    group = shm.group_for(dist.group.WORLD)
    same = len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    return same, shm.group_for(gloo_pg) is None, group is not None, group.token if group else ""


def _leftovers(token: str) -> List[str]:
    return glob.glob(f"/dev/shm/recshard-{token}-*")


@pytest.mark.parametrize("world_size,in_flight", [(2, 1), (3, 2), (4, 6)])
def test_shm_all_to_all_equals_gloo(world_size: int, in_flight: int) -> None:
    results = run_ranks(world_size, _compare, in_flight, timeout=120)
    for rank, (same, gloo_off, shm_on, token) in enumerate(results):
        assert gloo_off and shm_on, f"rank {rank}: switch {gloo_off}, shared memory {shm_on}"
        assert same, f"rank {rank}: shared-memory all-to-all differs from gloo's"
        assert token == results[0][3]
    assert _leftovers(results[0][3]) == []


def _switched_off(rank: int, ws: int, off_ranks: List[int]) -> Tuple[bool, List[float]]:
    os.environ[shm.ENV] = "0" if rank in off_ranks else "1"
    x = torch.arange(ws * 3, dtype=torch.float32) + 100 * rank
    got = issue_all_to_all(x, [3] * ws, [3] * ws, dist.group.WORLD, name="alltoallv").wait()
    return shm.group_for(dist.group.WORLD) is None, got.tolist()


@pytest.mark.parametrize("off_ranks", [[0, 1], [1]])
def test_switch_off_on_any_rank_gives_gloo(off_ranks: List[int]) -> None:
    """`RECSHARD_SHM_ALL_TO_ALL=0` on every rank, or on one: all ranks agree on gloo."""
    results = run_ranks(2, _switched_off, off_ranks, timeout=60)
    for rank, (gloo, got) in enumerate(results):
        assert gloo
        assert got == [3 * rank + i + 100 * s for s in range(2) for i in range(3)]


def _hosts(rank: int, ws: int) -> Tuple[bool, bool, List[float]]:
    """On 2 simulated hosts (LOCAL_WORLD_SIZE=2): the world group spans them, a host's own
    group does not."""
    host = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = host[rank // 2]
    x = torch.arange(ws * 2, dtype=torch.float32) + 100 * rank
    got = issue_all_to_all(x, [2] * ws, [2] * ws, dist.group.WORLD, name="alltoallv").wait()
    y = torch.arange(4, dtype=torch.float32) + 10 * rank
    issue_all_to_all(y, [2, 2], [2, 2], mine, name="alltoallv").wait()
    return shm.group_for(dist.group.WORLD) is None, shm.group_for(mine) is not None, got.tolist()


def test_simulated_hosts_keep_cross_host_traffic_off_shared_memory() -> None:
    """Ranks that simulate hosts on one machine (torchrun's layout via LOCAL_WORLD_SIZE) take
    the backend across "hosts", as real hosts must, and shared memory inside one: what the
    planner's transport model (`plan_stats`) assumes."""
    results = run_ranks(4, _hosts, timeout=120, env={"LOCAL_WORLD_SIZE": "2"})
    for rank, (world_backend, host_shm, got) in enumerate(results):
        assert world_backend and host_shm, f"rank {rank}: {world_backend}, {host_shm}"
        assert got == [2 * rank + i + 100 * s for s in range(4) for i in range(2)]


def _missing_peer(rank: int, ws: int) -> Tuple[str | None, str]:
    x = torch.ones(ws * (1 << 20))
    splits = [1 << 20] * ws
    issue_all_to_all(x, splits, splits, dist.group.WORLD, name="alltoall_pooled").wait()
    token = shm.group_for(dist.group.WORLD).token
    if rank == ws - 1:  # never issues the second call
        time.sleep(4.0)
        return None, token
    try:
        issue_all_to_all(x, splits, splits, dist.group.WORLD, name="alltoall_pooled_bwd").wait()
    except CollectiveError as e:
        return str(e), token
    return "no error", token


def test_missing_peer_raises_collective_error_naming_it() -> None:
    results = run_ranks(3, _missing_peer, timeout=90, env={"RECSHARD_PG_TIMEOUT_S": "2"})
    for message, _token in results[:-1]:
        assert message is not None and "rank 2" in message, message
        assert "pooled all-to-all (backward)" in message and "timed out" in message, message
    assert _leftovers(results[0][1]) == []
