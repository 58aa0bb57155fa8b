"""Tensor-parallel embeddings: split the embedding dim, or split the rows (vocabulary).

Both take the same ids on every rank of `pg` and accept `nn.Embedding`'s options
(`padding_idx`, `max_norm`, `norm_type`, `scale_grad_by_freq`, `sparse`) with its meaning.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recshard.comm.pg import HoldsGroup
from recshard.parallel.init import (
    InitMethod,
    embedding_master_weight,
    gather_master,
    shard_parameter,
)
from recshard.parallel.mappings import all_reduce, mp_gather, mp_reduce, mp_reduce_scatter
from recshard.parallel.utils import (
    ProcessGroup,
    ShardSpec,
    divide,
    group_rank,
    group_size,
)


def check_ids(ids: Tensor, num_embeddings: int, owner: str) -> None:
    """ValueError for non-integer ids or ids outside [0, num_embeddings) (before collectives)."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{owner} expects int32/int64 ids, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= num_embeddings)
    if bool(bad.any()):
        value = int(ids[bad][0])
        raise ValueError(f"{owner}: id {value} is out of range [0, {num_embeddings})")


def _normalize_padding_idx(padding_idx: int | None, num_embeddings: int, owner: str) -> int | None:
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"{owner}: padding_idx={padding_idx} must be within num_embeddings={num_embeddings}"
        )
    return padding_idx % num_embeddings


class _EmbeddingBase(HoldsGroup, nn.Module):
    """Options and master-weight plumbing shared by both embeddings."""

    shard_dim: int  # 1: embedding dim split; 0: rows split

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None,
        max_norm: float | None,
        norm_type: float,
        scale_grad_by_freq: bool,
        sparse: bool,
        init_method: InitMethod | None,
        pg: ProcessGroup | None,
        device: Any,
        dtype: torch.dtype | None,
        _weight: Tensor | None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.pg = pg
        self.world_size, self.rank = group_size(pg), group_rank(pg)
        what = "embedding_dim" if self.shard_dim == 1 else "num_embeddings"
        divide(
            embedding_dim if self.shard_dim == 1 else num_embeddings, self.world_size, what, owner
        )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = _normalize_padding_idx(padding_idx, num_embeddings, owner)
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        if _weight is None:
            _weight = embedding_master_weight(
                num_embeddings, embedding_dim, self.padding_idx, init_method, device, dtype
            )
        elif tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(
                f"{owner}: _weight has shape {tuple(_weight.shape)}, "
                f"expected {(num_embeddings, embedding_dim)}"
            )
        self.weight = shard_parameter(
            _weight, ShardSpec(self.shard_dim, self.rank, self.world_size)
        )

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, pg: ProcessGroup | None = None, **kwargs: Any
    ) -> _EmbeddingBase:
        """This rank's part of an existing `nn.Embedding` (same options, same outputs)."""
        return cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            embedding.max_norm,
            embedding.norm_type,
            embedding.scale_grad_by_freq,
            embedding.sparse,
            pg=pg,
            _weight=embedding.weight,
            **kwargs,
        )

    @property
    def master_weight(self) -> Tensor:
        """The full table [V, D] (collective: every rank must read it)."""
        return gather_master(self.weight, self.pg)

    def extra_repr(self) -> str:
        split = "embedding_dim" if self.shard_dim == 1 else "rows"
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, {split} split over "
            f"{self.world_size} ranks (rank {self.rank}), padding_idx={self.padding_idx}"
        )


@torch.no_grad()
def _renorm_split_rows_(
    weight: Tensor, ids: Tensor, max_norm: float, norm_type: float, pg: ProcessGroup | None
) -> None:
    """`nn.Embedding`'s max_norm rule for rows split by columns: the norm of a row is taken
    over the whole row (all ranks), then every rank scales its part of the row."""
    rows = ids.reshape(-1).unique()
    part = weight[rows].float().abs()
    if math.isinf(norm_type):
        norms = all_reduce(part.amax(dim=1), pg, "max")
    else:
        norms = all_reduce(part.pow(norm_type).sum(dim=1), pg, "sum").pow(1.0 / norm_type)
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
    weight[rows] *= scale.unsqueeze(1).to(weight.dtype)


class ParallelEmbedding(_EmbeddingBase):
    """Embedding with `embedding_dim` split across `pg`: each rank stores [V, D / ws].

    ids [*] (same on every rank) -> [*, D] all-gathered (replicated), or this rank's
    [*, D / ws] with `gather_output=False`.
    """

    shard_dim = 1

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod | None = None,
        pg: ProcessGroup | None = None,
        *,
        gather_output: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _weight: Tensor | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            init_method,
            pg,
            device,
            dtype,
            _weight,
        )
        self.embedding_dim_per_rank = embedding_dim // self.world_size
        self.gather_output = gather_output

    def forward(self, ids: Tensor) -> Tensor:
        check_ids(ids, self.num_embeddings, type(self).__name__)
        max_norm = self.max_norm
        if max_norm is not None and self.world_size > 1:
            _renorm_split_rows_(self.weight, ids, max_norm, self.norm_type, self.pg)
            max_norm = None  # done above, over whole rows
        out = F.embedding(
            ids,
            self.weight,
            self.padding_idx,
            max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        return mp_gather(out, -1, self.pg) if self.gather_output else out


class VocabParallelEmbedding(_EmbeddingBase):
    """Embedding with rows split across `pg`: rank r stores rows [r V/ws, (r+1) V/ws).

    ids [*] (same on every rank) -> [*, D], replicated: each rank looks up the ids it owns,
    leaves zeros elsewhere, and the partial results are summed (all-reduce), or
    reduce-scattered along `sequence_dim` (sequence parallelism).
    """

    shard_dim = 0

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod | None = None,
        pg: ProcessGroup | None = None,
        *,
        sequence_dim: int | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _weight: Tensor | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            init_method,
            pg,
            device,
            dtype,
            _weight,
        )
        self.rows_per_rank = num_embeddings // self.world_size
        self.row_start = self.rank * self.rows_per_rank
        self.sequence_dim = sequence_dim
        pad = self.padding_idx
        owns_pad = pad is not None and 0 <= pad - self.row_start < self.rows_per_rank
        self.local_padding_idx = pad - self.row_start if owns_pad else None  # type: ignore[operator]

    def forward(self, ids: Tensor) -> Tensor:
        check_ids(ids, self.num_embeddings, type(self).__name__)
        options = (self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        if self.world_size == 1:
            return F.embedding(ids, self.weight, self.local_padding_idx, *options)
        flat = ids.reshape(-1)
        local = flat - self.row_start
        positions = ((local >= 0) & (local < self.rows_per_rank)).nonzero().squeeze(1)
        # Look up only the ids owned here, so scale_grad_by_freq and max_norm see the true ids.
        rows = F.embedding(local[positions], self.weight, self.local_padding_idx, *options)
        out = rows.new_zeros(flat.numel(), self.embedding_dim).index_copy(0, positions, rows)
        out = out.view(*ids.shape, self.embedding_dim)
        if self.sequence_dim is None:
            return mp_reduce(out, self.pg)
        return mp_reduce_scatter(out, self.sequence_dim, self.pg)
