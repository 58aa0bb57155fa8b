"""Argument checks shared by the collectives: the group they run on, a condition that raises a
ValueError with its message, one dtype for a list of tensors, one (non-negative) entry per rank."""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


def default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """`group`, or the default process group."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


def check(condition: bool, message: str) -> None:
    """Raise `ValueError(message)` unless `condition`."""
    if not condition:
        raise ValueError(message)


def same_dtype(tensors: List[torch.Tensor], what: str) -> None:
    """All `tensors` share one dtype; `what` names the collective in the error."""
    dtypes = sorted({str(t.dtype) for t in tensors})
    check(len(dtypes) <= 1, f"{what}: all tensors must share one dtype, got {dtypes}")


def per_rank(values: List[int], pg: dist.ProcessGroup, what: str) -> List[int]:
    """`values` as a list, checked to hold one non-negative entry per rank of `pg`."""
    world_size = dist.get_world_size(pg)
    if len(values) != world_size:
        raise ValueError(
            f"{what} {list(values)} needs one entry per rank (world size {world_size})"
        )
    if any(v < 0 for v in values):
        raise ValueError(f"{what} {list(values)} must be non-negative")
    return list(values)


def one_entry_per_rank(what: str, world_size: int, **splits: Sequence[int]) -> None:
    """Each of `splits` (named by keyword) holds one entry per rank; `what` names the collective."""
    if any(len(values) != world_size for values in splits.values()):
        listed = " and ".join(f"{name} {list(values)}" for name, values in splits.items())
        verb = "needs" if len(splits) == 1 else "need"
        raise ValueError(f"{what}: {listed} {verb} one entry per rank (world size {world_size})")
