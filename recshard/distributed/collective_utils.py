"""Control flow over a process group (TorchRec's `torchrec.distributed.collective_utils`):
run a function on one rank and give every rank its result.

    plan = invoke_on_rank_and_broadcast_result(pg, 0, planner.plan, model, sharders)

    @run_on_leader(pg, 0)
    def allocate_id() -> int: ...

`rank` is the rank inside `pg` (TorchRec passes it to broadcast as a global rank, which is
only right on the default group). If the function raises on that rank, every rank raises
(with that rank's error) instead of the others waiting for a result that never comes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def is_leader(pg: dist.ProcessGroup | None, leader_rank: int = 0) -> bool:
    """True on the leader of `pg` (its rank `leader_rank`); with no group (a single process),
    True when `leader_rank` is 0."""
    if pg is None:
        return leader_rank == 0
    return pg.rank() == leader_rank


def invoke_on_rank_and_broadcast_result(
    pg: dist.ProcessGroup, rank: int, func: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """`func(*args, **kwargs)` run on rank `rank` of `pg` only; every rank returns its result
    (pickled and broadcast)."""
    if not 0 <= rank < pg.size():
        raise ValueError(f"rank {rank} is not in the process group (size {pg.size()})")
    outcome: list = [None]
    if pg.rank() == rank:
        try:
            outcome[0] = (True, func(*args, **kwargs))
        except Exception as err:  # every rank raises it, not only this one
            outcome[0] = (False, f"{type(err).__name__}: {err}")
            if pg.size() == 1:
                raise
    if pg.size() > 1:
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(pg, rank), group=pg)
    ok, value = outcome[0]
    if not ok:
        raise RuntimeError(f"rank {rank} failed in {getattr(func, '__name__', func)}: {value}")
    return value


def run_on_leader(
    pg: dist.ProcessGroup, rank: int
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: the function runs on rank `rank` of `pg`, every rank gets its result."""

    def decorate(func: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> T:
            return invoke_on_rank_and_broadcast_result(pg, rank, func, *args, **kwargs)

        return wrapped

    return decorate
