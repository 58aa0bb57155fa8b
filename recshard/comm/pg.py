"""Process-group helpers: node layout from the torchrun environment and intra/cross-node groups.

Table-row-wise sharding reduces within a node and exchanges across nodes. On one machine the
node size can be set explicitly (`local_world_size`) so those paths run in tests.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from datetime import timedelta
from typing import Dict, List, Set, Tuple

import torch
import torch.distributed as dist

from recshard.types import get_local_size  # noqa: F401 - re-exported for users

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "RECSHARD_PG_TIMEOUT_S"
DEFAULT_TIMEOUT = timedelta(seconds=300)
TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)  # what init_process_group gives gloo by default
_warned_groups: Set[dist.ProcessGroup] = set()


def pg_timeout(pg: dist.ProcessGroup | None = None) -> timedelta:
    """How long a collective may wait before it fails (a dead or stuck rank then raises).

    `RECSHARD_PG_TIMEOUT_S` when set (read at call time, not import time), else the timeout
    `pg` was created with (sub-groups inherit their parent's), else 300 s. Pass it to
    `init_process_group(timeout=pg_timeout())` so the default group follows the variable too.
    """
    if os.environ.get(TIMEOUT_ENV):
        text = os.environ[TIMEOUT_ENV]
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            raise ValueError(f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds")
        return timedelta(seconds=seconds)
    timeout = _group_timeout(pg) if pg is not None else None
    return timeout if timeout is not None else DEFAULT_TIMEOUT


def _group_timeout(pg: dist.ProcessGroup) -> timedelta | None:
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or no options
            continue
    return None


def warn_if_default_timeout(pg: dist.ProcessGroup | None) -> None:
    """Log once per group when the user's group waits torch's default 30 minutes: a dead or
    stuck rank then holds every other rank that long. recshard's own groups follow
    `RECSHARD_PG_TIMEOUT_S`; the user's group only if created with `timeout=pg_timeout()`."""
    if not dist.is_initialized():
        return
    pg = pg if pg is not None else dist.group.WORLD
    if pg in _warned_groups or _group_timeout(pg) != TORCH_DEFAULT_TIMEOUT:
        return
    _warned_groups.add(pg)
    logger.warning(
        "the process group has torch's default timeout of 30 minutes: a dead or stuck rank holds "
        "the others that long. Set %s (seconds; recshard's own groups follow it) and create the "
        "group with init_process_group(..., timeout=recshard.comm.pg.pg_timeout()) so that it "
        "follows it too",
        TIMEOUT_ENV,
    )


def get_local_rank(rank: int, local_world_size: int) -> int:
    """This rank's index inside its node (ranks are numbered node-major, as torchrun does)."""
    return rank % local_world_size


def get_node_index(rank: int, local_world_size: int) -> int:
    return rank // local_world_size


_GROUP_CACHE: Dict[Tuple[int, int], Tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def intra_and_cross_node_pg(
    pg: dist.ProcessGroup, local_world_size: int
) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Sub-groups of `pg`: the ranks of this node, and the ranks with this local rank on every
    node. Every rank of `pg` must call this (group creation is collective); results are cached
    per (pg, local_world_size)."""
    key = (id(pg), local_world_size)
    if key in _GROUP_CACHE:
        return _GROUP_CACHE[key]
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if world_size % local_world_size != 0:
        raise ValueError(f"local_world_size {local_world_size} must divide world_size {world_size}")
    global_ranks = dist.get_process_group_ranks(pg)
    num_nodes = world_size // local_world_size
    timeout = pg_timeout(pg)
    intra = cross = None
    for node in range(num_nodes):
        members = [global_ranks[node * local_world_size + i] for i in range(local_world_size)]
        group = dist.new_group(members, timeout=timeout)
        if node == get_node_index(rank, local_world_size):
            intra = group
    for local_rank in range(local_world_size):
        members = [global_ranks[node * local_world_size + local_rank] for node in range(num_nodes)]
        group = dist.new_group(members, timeout=timeout)
        if local_rank == get_local_rank(rank, local_world_size):
            cross = group
    assert intra is not None and cross is not None
    _GROUP_CACHE[key] = (intra, cross)
    return intra, cross


_exit_hook: List[bool] = []  # registered once per process
EXIT_DRAIN_S = 0.05


def destroy_groups_at_exit() -> None:
    """Let gloo's worker threads finish before the interpreter finalizes.

    gloo's worker thread drops its reference to a finished collective (and so to its
    tensors) just after `wait()` returns in the main thread; releasing the tensors' Python
    objects needs the GIL. A script that ends within a few milliseconds of its last
    collective (a handled error, the last step) never hands the GIL over: the thread is still
    waiting for it when the interpreter finalizes, is torn down inside a destructor, and the
    process aborts with "terminate called without an active exception" (exit -6) instead of
    its own exit code (seen with gdb; 18 of 60 processes that end right after an async
    all-gather on torch 2.13; issue #17), also when the program destroyed the groups itself.
    Every sharded embedding module (and DMP) registers this once: an `atexit` hook (it runs
    before finalization, when threads can still take the GIL) that releases the GIL for a
    moment so waiting workers finish, then destroys the groups the program left alive.
    """
    if not _exit_hook:
        _exit_hook.append(True)
        atexit.register(_drain_and_destroy_groups)


def _drain_and_destroy_groups() -> None:
    time.sleep(EXIT_DRAIN_S)  # releases the GIL: a worker waiting for it runs its destructor
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(EXIT_DRAIN_S)
    _GROUP_CACHE.clear()


class _GroupRef:
    """Holds a process group; deep copies share it (process groups cannot be copied)."""

    __slots__ = ("pg",)

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.pg = pg

    def __deepcopy__(self, memo: dict) -> _GroupRef:
        return self


class HoldsGroup:
    """Mixin for modules with a `pg` attribute, so `copy.deepcopy(module)` works (the copy
    uses the same group)."""

    _pg_ref: _GroupRef

    @property
    def pg(self) -> dist.ProcessGroup | None:
        return self._pg_ref.pg

    @pg.setter
    def pg(self, pg: dist.ProcessGroup | None) -> None:
        self._pg_ref = _GroupRef(pg)
