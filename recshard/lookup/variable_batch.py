"""The pooled layout of a variable batch per feature (VBE), as fbgemm's TBE returns it.

A lookup whose input KJT has `stride_per_key_per_rank` (`[F][W]`: the bags of feature f that
came from rank r) pools every bag once and returns one flat tensor, *rank-major*: for each
source rank r, for each feature f in lookup order, `B[f][r]` rows of f's dim. Each rank's
block is then one contiguous chunk of the output all-to-all / reduce-scatter
(`recshard.comm.variable_batch_alltoall_pooled`). These helpers convert between that layout
and per-feature `[B_f, D_f]` blocks (what a torch lookup pools), with autograd.

fbgemm's TBE is not asked for its own variable-batch layout: its CPU kernel pools a variable
batch about 25x slower than the same bags padded to one batch (fbgemm-gpu-cpu 1.8, 12 tables,
batches 1 and 2048: 647 vs 27 ms forward + backward), and its CUDA one is not tested here. The
lookup pads each feature's bags to the largest batch (`pad_lengths`: empty bags, pooled as zero
rows no one reads) and cuts the rows out (`padded_to_rank_major`).
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
    per_feature: Sequence[torch.Tensor],
    batch_per_feature_per_rank: Sequence[Sequence[int]],
    device: torch.device,
) -> torch.Tensor:
    """Per-feature `[B_f, D_f]` (rows grouped by source rank) -> the flat rank-major layout
    (on `device`: the lookup's, also when there are no features)."""
    if not per_feature:
        return torch.empty(0, device=device)
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


def pad_lengths(lengths: torch.Tensor, batch_per_feature: Sequence[int]) -> torch.Tensor:
    """`[sum B_f]` bag lengths, feature-major -> `[F * max B_f]`: each feature's bags then
    empty ones (one fixed batch)."""
    batch = max(batch_per_feature, default=0)
    strides = torch.tensor(list(batch_per_feature), device=lengths.device)
    filled = torch.arange(batch, device=lengths.device) < strides.unsqueeze(1)  # [F, batch]
    return (
        lengths.new_zeros(len(batch_per_feature), batch).masked_scatter_(filled, lengths).view(-1)
    )


def padded_to_rank_major(
    pooled: torch.Tensor,
    batch_per_feature_per_rank: Sequence[Sequence[int]],
    dims: Sequence[int],
) -> torch.Tensor:
    """`[max B_f, sum D_f]` pooled over padded bags -> the flat rank-major layout of the
    features' own rows (feature f's first `sum_r B[f][r]` rows of its columns)."""
    per_feature = [
        piece[: sum(b)]
        for piece, b in zip(pooled.split(list(dims), dim=1), batch_per_feature_per_rank)
    ]
    return to_rank_major(per_feature, batch_per_feature_per_rank, pooled.device)


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
