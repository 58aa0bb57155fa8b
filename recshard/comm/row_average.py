"""The DDP gradient average for an embedding table, sending only the rows in use.

A data-parallel table's gradient `[rows, D]` is zero on every row no rank looked up in the
step, and the average of zeros is zero: exchanging only the rows some rank looked up gives
exactly the dense all-reduce's result. The ranks first agree on those rows with a
one-byte-per-row all-reduce (MAX) of their looked-up ids, then sum the gathered rows. When
most rows are in use the dense all-reduce is cheaper and is used instead (the choice is the
same on every rank: it depends only on the agreed rows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def average_rows_over_ranks(
    grad: torch.Tensor, ids: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """`grad` `[rows, D]` <- its mean over the ranks of `group`, in place; returns `grad`.

    `ids`: the rows this rank looked up (duplicates allowed); `grad` must be zero elsewhere.
    Every rank must call this for the same table in the same order (it runs collectives).
    """
    world_size = dist.get_world_size(group)
    in_use = torch.zeros(grad.size(0), dtype=torch.uint8, device=grad.device)
    in_use[ids] = 1
    dist.all_reduce(in_use, op=dist.ReduceOp.MAX, group=group)
    rows = in_use.nonzero().squeeze(1)
    if 2 * rows.numel() > grad.size(0):
        dist.all_reduce(grad, group=group)
        return grad.div_(world_size)
    used = grad.index_select(0, rows)
    dist.all_reduce(used, group=group)
    return grad.index_copy_(0, rows, used.div_(world_size))
