"""Which transport carries a process group's flat collectives, and the one place that issues them.

A group whose ranks all run on one host moves its all-to-alls (and the reduce-scatters and
all-gathers that recshard builds from all-to-alls on CPU) through private shared memory
(`recshard.comm.shm`); every other group, and every rank where that transport is off, uses the
backend (gloo, NCCL). The choice is made once per group, collectively, at its first all-to-all
(`shm.group_for`), so all ranks of a group always agree. Callers get back something with
`wait()`: a backend `dist.Work` or a `shm.Exchange`, and the name of the operation to put in
an error message.

Switches: `RECSHARD_SHM_ALL_TO_ALL=0` turns the shared-memory transport off (on any rank: the
whole group then uses the backend); `RECSHARD_SHM_CAP_MB` sets the bytes of shared memory one
rank may hold for one group (default `DEFAULT_CAP_BYTES`); a call larger than that streams
through in pieces.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

from recshard.comm import shm
from recshard.comm.errors import collective_error
from recshard.comm.shm_hooks import NO_HOOKS, Hooks
from recshard.comm.shm_setup import CAP_ENV, DEFAULT_CAP_BYTES, ENV, cap_bytes, enabled

__all__ = [
    "CAP_ENV",
    "DEFAULT_CAP_BYTES",
    "ENV",
    "all_gather",
    "all_to_all",
    "cap_bytes",
    "enabled",
    "held_bytes",
    "reduce_scatter",
    "skips_copies",
    "uses_shared_memory",
]

Work = dist.Work | shm.Exchange


def uses_shared_memory(pg: dist.ProcessGroup) -> bool:
    """Whether `pg`'s all-to-alls go through shared memory (decides it, collectively, at the
    first call on `pg`: every rank of `pg` must call this, or issue an all-to-all, then)."""
    return shm.group_for(pg) is not None


def skips_copies(pg: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `all_to_all` on `pg` for tensors on `device` honours its `hooks` (the
    shared-memory transport); decided at `pg`'s first all-to-all, like `uses_shared_memory`."""
    return device.type == "cpu" and uses_shared_memory(pg)


def held_bytes(pg: dist.ProcessGroup) -> int:
    """Bytes of shared memory this rank holds for `pg` now (its own segments; 0 on the
    backend): at most `cap_bytes()`."""
    return shm.held_bytes(pg)


def start(name: str, op: str, pg: dist.ProcessGroup, issue: Callable[[], dist.Work]) -> dist.Work:
    """Issue a backend collective; an error raised at issue time names the collective too."""
    try:
        return issue()
    except RuntimeError as e:  # backend errors; ValueError/TypeError are argument bugs, kept
        raise collective_error(name, op, pg, e, stage="could not start") from e


def all_to_all(
    out: torch.Tensor,
    wire: torch.Tensor,
    output_sizes: List[int],
    input_sizes: List[int],
    pg: dist.ProcessGroup,
    name: str,
    hooks: Hooks | None = None,
) -> Tuple[Work, str]:
    """All-to-all-v of `wire[1-D, contiguous]` (`input_sizes[r]` elements to rank r) into
    `out` (`output_sizes[r]` from rank r, in rank order), issued now: `(work, op)`.

    `hooks` (`Hooks`) apply through shared memory only (`skips_copies`); the backend
    sends `wire` as it is, copies every part into `out` and calls no hook."""
    if wire.device.type == "cpu":
        local = shm.issue(pg, wire, input_sizes, output_sizes, out, name, hooks or NO_HOOKS)
        if local is not None:
            return local, shm.OP
    op = "all_to_all_single"
    work = start(
        name,
        op,
        pg,
        lambda: dist.all_to_all_single(
            out, wire, output_sizes, input_sizes, group=pg, async_op=True
        ),
    )
    return work, op


def reduce_scatter(
    out: torch.Tensor, wire: torch.Tensor, sizes: List[int], pg: dist.ProcessGroup, name: str
) -> Tuple[Work, str]:
    """The backend's reduce-scatter(-v): `out` = the sum over ranks of their chunk `rank` of
    `wire` cut into `sizes`."""
    if len(set(sizes)) == 1:
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        op = "reduce_scatter_tensor"
        return start(name, op, pg, lambda: fn(out, wire, group=pg, async_op=True)), op
    op = "reduce_scatter"
    chunks = list(wire.split(sizes))
    return start(
        name, op, pg, lambda: dist.reduce_scatter(out, chunks, group=pg, async_op=True)
    ), op


def all_gather(
    out: torch.Tensor, wire: torch.Tensor, sizes: List[int], pg: dist.ProcessGroup, name: str
) -> Tuple[Work, str]:
    """The backend's all-gather(-v): every rank's `wire` (`sizes[r]` elements from rank r)
    into `out`, in rank order."""
    if len(set(sizes)) == 1:
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        op = "all_gather_into_tensor"
        return start(name, op, pg, lambda: fn(out, wire, group=pg, async_op=True)), op
    op = "all_gather"
    chunks = list(out.split(sizes))
    return start(name, op, pg, lambda: dist.all_gather(chunks, wire, group=pg, async_op=True)), op
