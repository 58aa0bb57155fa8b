"""Permutes between rank-major (what an all-to-all delivers: every source rank's block) and
feature-major (a KJT's order: every key's bags, source ranks in batch order)."""

from __future__ import annotations

from typing import List

import torch

from recshard.sparse import jagged_ops as ops


def rank_order(num_splits: int, stagger: int) -> List[int]:
    """Source ranks in output batch order (stagger > 1 interleaves nodes, as TorchRec's TWRW)."""
    per_group = num_splits // stagger
    return [x + per_group * y for x in range(per_group) for y in range(stagger)]


def get_recat(
    local_split: int,
    num_splits: int,
    stagger: int = 1,
    device: torch.device | None = None,
    batch_size_per_rank: List[int] | None = None,
) -> torch.Tensor:
    """Permute from rank-major (what arrives) to feature-major (the output KJT), int32.

    Segment level `[F_local * W]` (output segment (f, j) = arrived segment
    `order[j] * F_local + f`) when every rank has the same batch size; bag level
    `[F_local * sum(B)]` when `batch_size_per_rank` differ (TorchRec's convention).
    """
    order = rank_order(num_splits, stagger)
    recat = [r * local_split + f for f in range(local_split) for r in order]
    recat_t = torch.tensor(recat, dtype=torch.int32, device=device)
    if batch_size_per_rank is None or len(set(batch_size_per_rank)) <= 1:
        return recat_t
    bags = [batch_size_per_rank[r] for r in range(num_splits) for _ in range(local_split)]
    return expand_recat(recat_t, torch.tensor(bags, dtype=torch.int32, device=device))


def expand_recat(segment_recat: torch.Tensor, segment_sizes: torch.Tensor) -> torch.Tensor:
    """A segment permute expanded to the elements of the segments
    (`segment_sizes`, source order)."""
    in_offsets = ops.asynchronous_complete_cumsum(segment_sizes)
    permuted = segment_sizes[segment_recat.long()]
    out_offsets = ops.asynchronous_complete_cumsum(permuted)
    return ops.expand_into_jagged_permute(
        segment_recat, in_offsets, out_offsets, int(permuted.sum())
    )
