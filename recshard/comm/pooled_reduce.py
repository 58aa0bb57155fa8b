"""Pooled embeddings by reduce-scatter and all-gather: partial pools summed onto the rank that
owns the batch (row-wise sharding), and the dual all-gather. Functions with autograd (TorchRec's
`comm_ops` names) and the `nn.Module`s over them (TorchRec's `dist_data` names).

Backward runs the transposed collective (reduce-scatter <-> all-gather, `request.py`).
World size 1 returns the input untouched.
"""

from __future__ import annotations

import math
from typing import List

import torch
import torch.distributed as dist
from torch import nn

from recshard.comm.args import check, default_group, one_entry_per_rank, per_rank, same_dtype
from recshard.comm.codecs import QuantizedCommCodecs
from recshard.comm.pg import HoldsGroup
from recshard.comm.request import AllGatherV, CommRequest, ReduceScatterV
from recshard.types import Awaitable, NoWait


def reduce_scatter_pooled(
    inputs: List[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """`inputs[r]` summed over ranks lands on rank r (shape of `inputs[r]`, same on every rank)."""
    pg = default_group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    check(
        len(inputs) == world_size,
        f"reduce_scatter_pooled: needs one input per rank ({world_size}), got {len(inputs)}",
    )
    same_dtype(inputs, "reduce_scatter_pooled")
    if world_size == 1:
        return NoWait(inputs[0])
    shape = inputs[rank].shape
    flat = torch.cat([t.reshape(-1) for t in inputs])
    rs = ReduceScatterV(pg, [t.numel() for t in inputs], codecs, name="reduce_scatter_pooled")
    return CommRequest(rs, flat, lambda out: out.view(shape))


def reduce_scatter_base_pooled(
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """`[W * B, D]` partial sums on every rank -> `[B, D]`: rows `r*B..(r+1)*B`
    summed, on rank r."""
    pg = default_group(group)
    world_size = dist.get_world_size(pg)
    check(
        input.size(0) % world_size == 0,
        f"reduce_scatter_base_pooled: {input.size(0)} rows do not split evenly "
        f"over {world_size} ranks",
    )
    return reduce_scatter_v_pooled(input, [input.size(0) // world_size] * world_size, pg, codecs)


def reduce_scatter_v_pooled(
    input: torch.Tensor,
    input_splits: List[int],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """`[sum(input_splits), D...]` partial sums -> `[input_splits[r], D...]` on rank r: the sum
    over ranks of row block r (uneven batch sizes per rank). Backward: all-gather."""
    pg = default_group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    one_entry_per_rank("reduce_scatter_v_pooled", world_size, input_splits=input_splits)
    check(
        input.size(0) == sum(input_splits),
        f"reduce_scatter_v_pooled: input has {input.size(0)} rows, input_splits "
        f"{input_splits} sum to {sum(input_splits)}",
    )
    if world_size == 1:
        return NoWait(input)
    row = math.prod(input.shape[1:])
    shape = (input_splits[rank], *input.shape[1:])
    rs = ReduceScatterV(pg, [n * row for n in input_splits], codecs, name="reduce_scatter_v_pooled")
    return CommRequest(rs, input.reshape(-1), lambda out: out.view(shape))


def reduce_scatter_v_per_feature_pooled(
    input: torch.Tensor,
    batch_size_per_rank_per_feature: List[List[int]],
    embedding_dims: List[int],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """Variable batch per feature (VBE) partial pools, flat and rank-major (for each rank r,
    for each feature f, `batch_size_per_rank_per_feature[r][f]` rows of `embedding_dims[f]`)
    -> rank r's chunk summed over ranks, on rank r (flat). Backward: all-gather."""
    pg = default_group(group)
    world_size = dist.get_world_size(pg)
    check(
        len(batch_size_per_rank_per_feature) == world_size,
        f"reduce_scatter_v_per_feature_pooled: batch_size_per_rank_per_feature has "
        f"{len(batch_size_per_rank_per_feature)} entries, world size is {world_size}",
    )
    splits = [
        sum(b * d for b, d in zip(batches, embedding_dims))
        for batches in batch_size_per_rank_per_feature
    ]
    return reduce_scatter_v_pooled(input.reshape(-1), splits, pg, codecs)


def all_gather_base_pooled(
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """`[B, D...]` on every rank -> `[W * B, D...]`, rank blocks in rank order.
    Backward: reduce-scatter (divided by W when gradient division is on, as TorchRec)."""
    pg = default_group(group)
    world_size = dist.get_world_size(pg)
    if world_size == 1:
        return NoWait(input)
    shape = (world_size * input.size(0), *input.shape[1:])
    ag = AllGatherV(pg, [input.numel()] * world_size, codecs, name="all_gather_base_pooled")
    return CommRequest(ag, input.reshape(-1), lambda out: out.view(shape))


class PooledEmbeddingsReduceScatter(HoldsGroup, nn.Module):
    """Partial pools `[sum(B_r), D]` on every rank -> summed `[B_me, D]` (row-wise sharding).

    `input_splits` (rows per rank) for unequal batch sizes; default equal.
    """

    def __init__(self, pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None) -> None:
        super().__init__()
        self.pg, self._codecs = pg, codecs

    def forward(
        self, local_embs: torch.Tensor, input_splits: List[int] | None = None
    ) -> Awaitable[torch.Tensor]:
        if input_splits is not None and len(set(input_splits)) > 1:
            return reduce_scatter_v_pooled(local_embs, input_splits, self.pg, self._codecs)
        if input_splits is not None:
            per_rank(input_splits, self.pg, "PooledEmbeddingsReduceScatter: input_splits")
        return reduce_scatter_base_pooled(local_embs, self.pg, self._codecs)


class VariableBatchPooledEmbeddingsReduceScatter(HoldsGroup, nn.Module):
    """Variable batch per feature (VBE) partial pools, flat and rank-major, on every rank ->
    this rank's chunk summed (row-wise sharding); see `reduce_scatter_v_per_feature_pooled`."""

    def __init__(self, pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None) -> None:
        super().__init__()
        self.pg, self._codecs = pg, codecs

    def forward(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank_per_feature: List[List[int]],
        embedding_dims: List[int],
    ) -> Awaitable[torch.Tensor]:
        return reduce_scatter_v_per_feature_pooled(
            local_embs, batch_size_per_rank_per_feature, embedding_dims, self.pg, self._codecs
        )


class PooledEmbeddingsAllGather(HoldsGroup, nn.Module):
    """`[B, D]` on every rank -> `[W * B, D]` in rank order; backward reduce-scatters."""

    def __init__(self, pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None) -> None:
        super().__init__()
        self.pg, self._codecs = pg, codecs

    def forward(self, local_emb: torch.Tensor) -> Awaitable[torch.Tensor]:
        return all_gather_base_pooled(local_emb, self.pg, self._codecs)
