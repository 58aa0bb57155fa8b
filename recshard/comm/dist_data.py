"""Output-dist modules: embeddings from model-parallel back to data-parallel layout.

Thin `nn.Module`s over the collectives in `ops.py`, with TorchRec's constructor and call
arguments. Each call returns an `Awaitable` (callbacks run at `wait()`).
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from recshard.comm.codecs import QuantizedCommCodecs
from recshard.comm.column_blocks import Block, check_blocks
from recshard.comm.ops import (
    all_gather_base_pooled,
    alltoall_pooled,
    alltoall_sequence,
    reduce_scatter_base_pooled,
    reduce_scatter_v_pooled,
    variable_batch_alltoall_pooled,
)
from recshard.comm.pg import HoldsGroup
from recshard.comm.recat import get_recat
from recshard.types import Awaitable

Callback = Callable[[torch.Tensor], torch.Tensor]


def _per_rank(values: List[int], pg: dist.ProcessGroup, what: str) -> List[int]:
    world_size = dist.get_world_size(pg)
    if len(values) != world_size:
        raise ValueError(
            f"{what} {list(values)} needs one entry per rank (world size {world_size})"
        )
    if any(v < 0 for v in values):
        raise ValueError(f"{what} {list(values)} must be non-negative")
    return list(values)


class PooledEmbeddingsAllToAll(HoldsGroup, nn.Module):
    """`[B_global, dim_sum_per_rank[me]]` -> `[B_local, sum(dim_sum_per_rank)]` (table-wise).

    Example: `dim_sum_per_rank=[2, 1]`, two ranks, `[6, 2]` on rank 0 and `[6, 1]` on rank 1
    give `[3, 3]` on each: columns 0-1 from rank 0, column 2 from rank 1.
    `batch_size_per_rank` (call) supports unequal batches; default `B_global / W` each.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        dim_sum_per_rank: List[int],
        device: torch.device | None = None,
        callbacks: List[Callback] | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self.pg = pg
        self._dim_sum_per_rank = _per_rank(
            dim_sum_per_rank, pg, "PooledEmbeddingsAllToAll: dim_sum_per_rank"
        )
        self._callbacks: List[Callback] = list(callbacks or [])
        self._codecs = codecs
        self._column_blocks: List[Block] | None = None

    @property
    def callbacks(self) -> List[Callback]:
        return self._callbacks

    def set_column_order(self, blocks: Sequence[Block]) -> None:
        """Deliver columns as these (rank, first column, width) blocks, in this order, instead
        of rank order: the caller's permute rides on the all-to-all's own copy."""
        self._column_blocks = check_blocks(blocks, self._dim_sum_per_rank)

    def forward(
        self, local_embs: torch.Tensor, batch_size_per_rank: List[int] | None = None
    ) -> Awaitable[torch.Tensor]:
        world_size = dist.get_world_size(self.pg)
        if batch_size_per_rank is None:
            if local_embs.size(0) % world_size:
                raise ValueError(
                    f"PooledEmbeddingsAllToAll: {local_embs.size(0)} rows do not split evenly "
                    f"over {world_size} ranks; pass batch_size_per_rank"
                )
            batch_size_per_rank = [local_embs.size(0) // world_size] * world_size
        awaitable = alltoall_pooled(
            local_embs,
            batch_size_per_rank,
            self._dim_sum_per_rank,
            group=self.pg,
            codecs=self._codecs,
            column_blocks=self._column_blocks,
        )
        awaitable.callbacks.extend(self._callbacks)
        return awaitable


class VariableBatchPooledEmbeddingsAllToAll(HoldsGroup, nn.Module):
    """Pooled all-to-all with a batch size per rank per feature (VBE); flat in and out.

    `emb_dim_per_rank_per_feature[r]`: dims of rank r's features. See
    `variable_batch_alltoall_pooled` for the layouts.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        emb_dim_per_rank_per_feature: List[List[int]],
        device: torch.device | None = None,
        callbacks: List[Callback] | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        world_size = dist.get_world_size(pg)
        if len(emb_dim_per_rank_per_feature) != world_size:
            raise ValueError(
                f"VariableBatchPooledEmbeddingsAllToAll: emb_dim_per_rank_per_feature has "
                f"{len(emb_dim_per_rank_per_feature)} entries, world size is {world_size}"
            )
        self.pg = pg
        self._emb_dims = [list(d) for d in emb_dim_per_rank_per_feature]
        self._callbacks: List[Callback] = list(callbacks or [])
        self._codecs = codecs

    @property
    def callbacks(self) -> List[Callback]:
        return self._callbacks

    def forward(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank_per_feature: List[List[int]],
        batch_size_per_feature_pre_a2a: List[int],
    ) -> Awaitable[torch.Tensor]:
        awaitable = variable_batch_alltoall_pooled(
            local_embs,
            batch_size_per_rank_per_feature,
            batch_size_per_feature_pre_a2a,
            self._emb_dims,
            group=self.pg,
            codecs=self._codecs,
        )
        awaitable.callbacks.extend(self._callbacks)
        return awaitable


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
            _per_rank(input_splits, self.pg, "PooledEmbeddingsReduceScatter: input_splits")
        return reduce_scatter_base_pooled(local_embs, self.pg, self._codecs)


class PooledEmbeddingsAllGather(HoldsGroup, nn.Module):
    """`[B, D]` on every rank -> `[W * B, D]` in rank order; backward reduce-scatters."""

    def __init__(self, pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None) -> None:
        super().__init__()
        self.pg, self._codecs = pg, codecs

    def forward(self, local_emb: torch.Tensor) -> Awaitable[torch.Tensor]:
        return all_gather_base_pooled(local_emb, self.pg, self._codecs)


class SequenceEmbeddingsAllToAll(HoldsGroup, nn.Module):
    """Per-id embeddings back to the ranks whose batches the ids came from.

    Call with the metadata of the `KJTAllToAll` that brought the ids here (its tensors
    awaitable `aw` and output KJT `kjt`):
    `seq_a2a(embs, kjt.lengths(), aw.input_splits["values"], aw.output_splits["values"],
    batch_size_per_rank=aw.stride_per_rank, sparse_features_recat=aw.recat)`.
    `embs [N_recv, D]`: one row per value of `kjt`, in its order. Result `[N_sent, D]`: one
    row per value of the KJT this rank sent, in its order (then `index_select`ed by
    `unbucketize_permute_tensor` if given, which row-wise sharding uses).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        features_per_rank: List[int],
        device: torch.device | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self.pg = pg
        self._features_per_rank = _per_rank(
            features_per_rank, pg, "SequenceEmbeddingsAllToAll: features_per_rank"
        )
        self._codecs = codecs

    def forward(
        self,
        local_embs: torch.Tensor,
        lengths: torch.Tensor,
        input_splits: List[int],
        output_splits: List[int],
        unbucketize_permute_tensor: torch.Tensor | None = None,
        batch_size_per_rank: List[int] | None = None,
        sparse_features_recat: torch.Tensor | None = None,
    ) -> Awaitable[torch.Tensor]:
        world_size, rank = dist.get_world_size(self.pg), dist.get_rank(self.pg)
        num_local = self._features_per_rank[rank]
        variable = batch_size_per_rank is not None and len(set(batch_size_per_rank)) > 1
        recat = sparse_features_recat
        if recat is None:
            recat = get_recat(num_local, world_size, 1, local_embs.device, batch_size_per_rank)
        variable = variable or recat.numel() != num_local * world_size
        forward_recat = torch.argsort(recat.long()).to(torch.int32)
        awaitable = alltoall_sequence(
            local_embs,
            forward_recat,
            recat,
            lengths,
            input_splits,
            output_splits,
            variable_batch_size=variable,
            group=self.pg,
            codecs=self._codecs,
        )
        if unbucketize_permute_tensor is not None:
            permute = unbucketize_permute_tensor.long()
            awaitable.callbacks.append(lambda embs: embs.index_select(0, permute))
        return awaitable


class EmbeddingsAllToOne(nn.Module):
    """Single process, several devices: every device's `[B, D_i]` joined on `device`
    (concatenated along `cat_dim`). On CPU it is a concatenation."""

    def __init__(self, device: torch.device, world_size: int, cat_dim: int) -> None:
        super().__init__()
        self._device, self._world_size, self._cat_dim = torch.device(device), world_size, cat_dim

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != self._world_size:
            raise ValueError(
                f"EmbeddingsAllToOne: expected {self._world_size} tensors, got {len(tensors)}"
            )
        return torch.cat([t.to(self._device) for t in tensors], dim=self._cat_dim)


class EmbeddingsAllToOneReduce(nn.Module):
    """Single process, several devices: every device's `[B, D]` summed on `device`."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        super().__init__()
        self._device, self._world_size = torch.device(device), world_size

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != self._world_size:
            raise ValueError(
                f"EmbeddingsAllToOneReduce: expected {self._world_size} tensors, got {len(tensors)}"
            )
        return torch.stack([t.to(self._device) for t in tensors]).sum(0)
