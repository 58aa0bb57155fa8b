"""The shared-memory transport can never deliver wrong bytes, hang, leak or expose data
(issue 36), across real processes.

- A rank that exits right after its last call still delivers its bytes to a slower peer.
- Segments have no name: no path under /dev/shm is ever opened or mapped, each segment is a
  private (mode 0600, this uid, no link) regular file, another user cannot open it through
  /proc, and no listening socket is left once the group is set up.
- A rank in a private mount namespace with its own /dev/shm neither hangs nor breaks anything.
- A rank that cannot reserve its segment makes the whole group use the backend.
- SIGTERM, os._exit or SIGKILL of one rank: its peers raise promptly, naming it.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing.util
import os
import re
import signal
import stat
import subprocess
import time
from typing import List, Tuple

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from recshard.comm import shm, transport
from recshard.comm.errors import CollectiveError
from recshard.comm.request import issue_all_to_all

MI = 1 << 20


def _exit_race(rank: int, ws: int) -> Tuple[bool, float]:
    """Rank 1 sends 1 Mi floats to rank 0 and exits at once; rank 0 takes them late (rank 0
    keeps the group's store, so rank 1 is the one that leaves)."""
    x = torch.arange(MI, dtype=torch.float32) if rank == 1 else torch.empty(0)
    ins, outs = ([MI, 0], [0, 0]) if rank == 1 else ([0, 0], [0, MI])
    pending = issue_all_to_all(x, ins, outs, dist.group.WORLD, name="alltoall_pooled")
    if rank == 1:
        pending.wait()
        atexit.unregister(multiprocessing.util._exit_function)  # the harness's own
        atexit._run_exitfuncs()  # what a normal interpreter exit runs (the harness skips it)
        return True, 0.0
    time.sleep(2.0)  # rank 1 has returned, left its group and exited by now
    got = pending.wait()
    return torch.equal(got, torch.arange(MI, dtype=torch.float32)), float(got.sum())


def test_a_rank_that_exits_at_once_still_delivers_its_bytes() -> None:
    results = run_ranks(2, _exit_race, timeout=60)
    assert results[0][0], f"rank 0 received wrong bytes (sum {results[0][1]})"


def _dev_shm_paths() -> List[str]:
    """Paths under /dev/shm this process has open or mapped."""
    found = [
        line.split(None, 5)[5].strip()
        for line in open("/proc/self/maps")
        if len(line.split(None, 5)) == 6 and "/dev/shm/" in line
    ]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            found.append(target)
    return [p for p in found if "/sem.mp-" not in p]  # the test harness's own queues


def _privacy(rank: int, ws: int) -> dict:
    before = set(os.listdir("/dev/shm"))
    sizes = [3 * MI] * ws
    pendings = [
        issue_all_to_all(torch.ones(ws * 3 * MI), sizes, sizes, dist.group.WORLD, name=n)
        for n in ("alltoall_pooled", "kjt_all_to_all_values")
    ]
    paths = _dev_shm_paths()  # while calls are in flight
    for p in pendings:
        p.wait()
    group = shm.group_for(dist.group.WORLD)
    info = os.fstat(group.ring.segment.fd)
    fd_path = f"/proc/{os.getpid()}/fd/{group.ring.segment.fd}"
    other_user = subprocess.run(
        ["runuser", "-u", "nobody", "--", "cat", fd_path], capture_output=True, timeout=30
    )
    listening = [  # __SO_ACCEPTCON: a listener (accepted sockets show its name too)
        line
        for line in open("/proc/net/unix")
        if "@recshard-" in line and line.split()[3] == "00010000"
    ]
    dist.barrier()
    return dict(
        paths=paths + _dev_shm_paths(),
        new_names=sorted(set(os.listdir("/dev/shm")) - before),
        mode=stat.S_IMODE(info.st_mode),
        regular=stat.S_ISREG(info.st_mode),
        uid=info.st_uid,
        links=info.st_nlink,
        other_user=(other_user.returncode, len(other_user.stdout)),
        listening=listening,
        my_pid=os.getpid(),
    )


def test_segments_have_no_name_and_no_other_user_can_open_them() -> None:
    results = run_ranks(2, _privacy, timeout=90)
    for r in results:
        assert r["paths"] == [], r["paths"]  # no file under /dev/shm opened or mapped
        assert not [n for n in r["new_names"] if "recshard" in n], r["new_names"]
        assert r["regular"] and r["mode"] == 0o600 and r["uid"] == os.getuid(), r
        assert r["links"] == 0  # anonymous: no name anywhere
        code, read = r["other_user"]
        assert code != 0 and read == 0, r["other_user"]
        assert r["listening"] == [], r["listening"]  # the set-up listeners are gone


_CLONE_NEWNS, _MS_REC, _MS_PRIVATE = 0x00020000, 0x4000, 1 << 18


def _private_dev_shm() -> str | None:
    """Give this thread a private mount namespace with an empty 1 MiB tmpfs on /dev/shm (what a
    container with its own /dev/shm has); the reason when that is not possible here."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return f"private propagation: {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"size=1m") != 0:
        return f"mount: {os.strerror(ctypes.get_errno())}"
    return None


def _namespaces(rank: int, ws: int) -> Tuple[str | None, int, bool, bool]:
    problem = _private_dev_shm() if rank == 1 else None
    dist.barrier()
    x = torch.arange(ws * MI, dtype=torch.float32) + 1000 * rank
    got = issue_all_to_all(x, [MI] * ws, [MI] * ws, dist.group.WORLD, name="alltoallv").wait()
    want = torch.cat(
        [torch.arange(MI, dtype=torch.float32) + rank * MI + 1000 * s for s in range(ws)]
    )
    return (
        problem,
        os.stat("/dev/shm").st_dev,
        torch.equal(got, want),
        transport.uses_shared_memory(dist.group.WORLD),
    )


def test_a_rank_with_its_own_dev_shm_neither_hangs_nor_breaks() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root for a mount namespace")
    results = run_ranks(2, _namespaces, timeout=60, env={"RECSHARD_PG_TIMEOUT_S": "10"})
    if results[1][0] is not None:
        pytest.skip(f"no private mount namespace here: {results[1][0]}")
    assert results[0][1] != results[1][1]  # rank 1 really sees another /dev/shm
    for _, _, same, _ in results:
        assert same
    assert results[0][3] == results[1][3]  # both ranks agree on the transport


def _no_room(rank: int, ws: int) -> Tuple[bool, List[float]]:
    import resource

    if rank == 1:  # this rank's kernel refuses to reserve its segment (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    x = torch.arange(ws * 3, dtype=torch.float32) + 100 * rank
    got = issue_all_to_all(x, [3] * ws, [3] * ws, dist.group.WORLD, name="alltoallv").wait()
    return transport.uses_shared_memory(dist.group.WORLD), got.tolist()


def test_a_rank_that_cannot_reserve_memory_makes_the_group_use_the_backend() -> None:
    results = run_ranks(3, _no_room, timeout=60)
    for rank, (used, got) in enumerate(results):
        assert not used, f"rank {rank} uses shared memory"
        assert got == [3 * rank + i + 100 * s for s in range(3) for i in range(3)]


def _death(rank: int, ws: int, how: str, dying: List[int]) -> str:
    """Every rank: a call, then a bigger one (a new segment generation); the ranks in `dying`
    stop right after issuing it (`how`); the others take it and issue a third call."""
    sizes = [MI] * ws
    issue_all_to_all(torch.ones(ws * MI), sizes, sizes, dist.group.WORLD).wait()
    sizes = [4 * MI] * ws
    x = torch.arange(ws * 4 * MI, dtype=torch.float32)
    second = issue_all_to_all(x, sizes, sizes, dist.group.WORLD, name="alltoall_pooled")
    if rank in dying:
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    try:
        second.wait()
        issue_all_to_all(x, sizes, sizes, dist.group.WORLD, name="alltoall_pooled_bwd").wait()
    except CollectiveError as e:
        return str(e)
    return "no error"


def _recshard_names() -> set:
    return {n for n in os.listdir("/dev/shm") if "recshard" in n}


@pytest.mark.parametrize("how", ["sigterm", "exit", "sigkill"])
def test_a_dead_rank_is_named_at_once_and_leaves_nothing(how: str) -> None:
    before = _recshard_names()
    # the collective timeout is far past the harness's: only seeing the death ends the wait
    env = {"RECSHARD_PG_TIMEOUT_S": "600"}
    results = run_ranks(3, _death, how, [2], timeout=90, may_die=[2], env=env)
    assert results[2][0] == "exited"
    for message in results[:2]:
        assert "rank 2" in message and "pooled all-to-all" in message, message
        assert re.search(r"rank 2 \(pid \d+\) (exited or closed|its connection broke)", message), (
            message
        )
    assert _recshard_names() - before == set()


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_a_job_stopped_with_calls_in_flight_leaves_nothing(how: str) -> None:
    before = _recshard_names()
    results = run_ranks(3, _death, how, [0, 1, 2], timeout=60, may_die=[0, 1, 2])
    assert all(r[0] == "exited" for r in results)
    assert _recshard_names() - before == set()


def _missing_peer(rank: int, ws: int) -> str | None:
    x = torch.ones(ws * MI)
    splits = [MI] * ws
    issue_all_to_all(x, splits, splits, dist.group.WORLD, name="alltoall_pooled").wait()
    if rank == ws - 1:  # never issues the second call
        time.sleep(4.0)
        return None
    try:
        issue_all_to_all(x, splits, splits, dist.group.WORLD, name="alltoall_pooled_bwd").wait()
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_missing_peer_raises_collective_error_naming_it() -> None:
    results = run_ranks(3, _missing_peer, timeout=90, env={"RECSHARD_PG_TIMEOUT_S": "2"})
    for message in results[:-1]:
        assert message is not None and "rank 2" in message, message
        assert "pooled all-to-all (backward)" in message and "timed out" in message, message
