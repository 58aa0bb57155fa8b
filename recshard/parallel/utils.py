"""Group helpers shared by the tensor-parallel layers: sizes, divisibility checks, shards.

`pg=None` means the default (WORLD) group; without an initialized process group the
layers run as a group of one, so they also work in a plain single-process script.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = dist.ProcessGroup


def group_size(pg: ProcessGroup | None = None) -> int:
    """Number of ranks in `pg` (1 when torch.distributed is not initialized)."""
    if pg is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(pg)


def group_rank(pg: ProcessGroup | None = None) -> int:
    """This rank's index inside `pg` (0 when torch.distributed is not initialized)."""
    if pg is None and not dist.is_initialized():
        return 0
    return dist.get_rank(pg)


def divide(value: int, parts: int, what: str, owner: str, by: str = "") -> int:
    """`value // parts`, or a ValueError naming the owner, the field and the group size."""
    if value % parts != 0:
        by = by or f"the model-parallel group size {parts}"
        raise ValueError(f"{owner}: {what}={value} is not divisible by {by}")
    return value // parts


def check_dim_size(x: Tensor, dim: int, parts: int, what: str) -> None:
    """Raise a ValueError when `x.shape[dim]` cannot be split evenly into `parts`."""
    if x.dim() == 0:
        raise ValueError(f"{what}: cannot split a 0-d tensor")
    if x.shape[dim] % parts != 0:
        raise ValueError(
            f"{what}: cannot split dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) "
            f"evenly across the model-parallel group of size {parts}"
        )


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is cut from its full tensor: `dim` split into `world_size * stride`
    equal chunks, this rank holding chunks `rank, rank + world_size, ...` (in that order)."""

    dim: int
    rank: int
    world_size: int
    stride: int = 1

    def full_shape(self, local: torch.Size) -> torch.Size:
        shape = list(local)
        shape[self.dim] *= self.world_size
        return torch.Size(shape)


def take_shard(full: Tensor, spec: ShardSpec) -> Tensor:
    """This rank's shard of `full` (a new contiguous tensor). [.., N, ..] -> [.., N/ws, ..]."""
    chunks = full.chunk(spec.world_size * spec.stride, dim=spec.dim)
    mine = [chunks[s * spec.world_size + spec.rank] for s in range(spec.stride)]
    return torch.cat(mine, dim=spec.dim).contiguous()


def unstride(gathered: Tensor, dim: int, world_size: int, stride: int) -> Tensor:
    """Reorder rank-major gathered shards (see ShardSpec) back into the full tensor's order."""
    if stride == 1:
        return gathered
    dim = dim % gathered.dim()
    shape = list(gathered.shape)
    chunk = shape[dim] // (world_size * stride)
    split = shape[:dim] + [world_size, stride, chunk] + shape[dim + 1 :]
    return gathered.reshape(split).transpose(dim, dim + 1).reshape(shape)


def mark_shard(param: Tensor, spec: ShardSpec) -> Tensor:
    """Record on a parameter how it was cut, for `shard_init_helper_` and `master_*`."""
    param.shard_spec = spec  # type: ignore[attr-defined]
    return param


def shard_spec_of(tensor: Tensor) -> ShardSpec | None:
    return getattr(tensor, "shard_spec", None)
