"""The pooled layout of a variable batch per feature (VBE), as fbgemm's TBE returns it.

A lookup whose input KJT has `stride_per_key_per_rank` (`[F][W]`: the bags of feature f that
came from rank r) pools every bag once and returns one flat tensor, *rank-major*: for each
source rank r, for each feature f in lookup order, `B[f][r]` rows of f's dim. Each rank's
block is then one contiguous chunk of the output all-to-all / reduce-scatter
(`recshard.comm.variable_batch_alltoall_pooled`). These helpers convert between that layout
and per-feature `[B_f, D_f]` blocks (what a torch lookup pools), with autograd.
"""

from __future__ import annotations

from typing import List, Sequence

import torch


def rank_chunk_sizes(
    batch_per_feature_per_rank: Sequence[Sequence[int]], dims: Sequence[int]
) -> List[int]:
    """Elements of each rank's chunk of the rank-major layout: `sum_f B[f][r] * D_f`."""
    world = len(batch_per_feature_per_rank[0]) if batch_per_feature_per_rank else 0
    return [sum(b[r] * d for b, d in zip(batch_per_feature_per_rank, dims)) for r in range(world)]


def to_rank_major(
    per_feature: Sequence[torch.Tensor], batch_per_feature_per_rank: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Per-feature `[B_f, D_f]` (rows grouped by source rank) -> the flat rank-major layout."""
    if not per_feature:
        return torch.empty(0)
    pieces = [p.split(list(b), dim=0) for p, b in zip(per_feature, batch_per_feature_per_rank)]
    world = len(batch_per_feature_per_rank[0])
    return torch.cat([pieces[f][r].reshape(-1) for r in range(world) for f in range(len(pieces))])


def from_rank_major(
    flat: torch.Tensor, batch_per_feature_per_rank: Sequence[Sequence[int]], dims: Sequence[int]
) -> List[torch.Tensor]:
    """The flat rank-major layout -> per-feature `[B_f, D_f]` (rows grouped by source rank)."""
    if not dims:
        return []
    world = len(batch_per_feature_per_rank[0])
    num = len(dims)
    sizes = [batch_per_feature_per_rank[f][r] * dims[f] for r in range(world) for f in range(num)]
    blocks = flat.reshape(-1).split(sizes)
    return [
        torch.cat([blocks[r * num + f].view(-1, dims[f]) for r in range(world)]) for f in range(num)
    ]


def join_rank_major(
    outputs: Sequence[torch.Tensor],
    batch_per_feature_per_rank: Sequence[Sequence[Sequence[int]]],
    dims: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Several lookups' rank-major outputs (their features side by side, in order) -> one
    rank-major output over all their features: each rank's chunks, lookup after lookup."""
    chunks = [
        out.reshape(-1).split(rank_chunk_sizes(b, d))
        for out, b, d in zip(outputs, batch_per_feature_per_rank, dims)
    ]
    world = max((len(c) for c in chunks), default=0)
    return torch.cat([c[r] for r in range(world) for c in chunks if c])
