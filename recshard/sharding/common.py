"""What every sharding type shares: its tables, its local lookup, and its place in the module.

A sharding type is a value (`ShardingType`) plus one module here per type that says how ids
are routed (`input_dist`) and how outputs come back (`output_dist`). Each sharding reads the
module's input features in its own *wire order* (`input_features`, which may repeat a feature
for column shards); the sharded module permutes its input once into the concatenation of all
wire orders and hands each sharding its slice.

Ids travel under the *embedding name* of each (table, feature) pair (TorchRec's name): the
feature itself, or `feature@table` for a feature several tables read. The input side copies
such a feature once per table under those names, so routing, lookups and outputs never see
two tables' copies under one key.

Each sharding builds its local lookup with the `LookupFactory` it is given: `GroupedLookup`
(trainable float tables, the default) or the quantized lookup of the inference modules
(`recshard.distributed.quant_shards`). Routing and output dists do not depend on which.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Protocol, Tuple

import torch
from torch import nn

from recshard.lookup.fused_params import FusedParams
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import BaseEmbeddingConfig, PoolingType
from recshard.modules.embedding_tables import embedding_names
from recshard.sparse import KeyedJaggedTensor
from recshard.types import (
    Awaitable,
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingEnv,
    ShardMetadata,
)

OutputColumns = List[Tuple[str, int, int]]  # (feature, column offset inside it, width)


class Lookup(Protocol):
    """A sharding's local lookup over this rank's shards (`GroupedLookup` is one).

    Input: KJT with keys `[f for t in self.tables for f in t.feature_names]`.
    Output: pooled `[B, sum of those features' local dims]`, or sequence `[N, D]`.
    """

    tables: List[LocalTable]
    kernels: nn.ModuleList  # `is_fused` ones hold an in-backward optimizer's state

    def table_weights(self) -> List[torch.Tensor]:
        """Each local shard's stored rows, in `tables` order (views)."""

    def __call__(self, features: KeyedJaggedTensor) -> torch.Tensor: ...


# (tables in lookup order, pooled, device, is_weighted) -> the lookup over them
LookupFactory = Callable[[List[LocalTable], bool, torch.device, bool], Lookup]


@dataclass
class EmbeddingShardingContext:
    """What one sharding's `input_dist` leaves for its `output_dist`, for one batch
    (TorchRec's name). Shardings that keep more subclass it and return it from
    `create_context`."""

    batch_size_per_rank: List[int] | None = None  # every rank's batch size, when they differ
    # A variable batch per feature (VBE, set once the ids arrived): the routed KJT had
    # `stride_per_key_per_rank`; the lookup and output dist use fbgemm's flat layout.
    variable_batch_per_feature: bool = False
    batch_size_per_feature_pre_a2a: List[int] = field(
        default_factory=list
    )  # this rank's, wire order
    batch_size_per_rank_per_feature: List[List[int]] = field(default_factory=list)  # [W][F_local]

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the device tensors kept here as used on `stream` (none in the base)."""


@dataclass
class TableSpec:
    """A table as a sharded module sees it: config, plan entry, fused optimizer params and,
    per feature, its embedding name (`with_embedding_names`; empty: the feature names).
    `output_dtype`: the dtype of the rows its lookup returns (quantized tables are dequantized
    to it); None: fp32, as the float lookups return rows of any float table (fbgemm's and
    TorchRec's default output dtype, also for FP16 weights)."""

    config: BaseEmbeddingConfig
    sharding: ParameterSharding
    fused_params: FusedParams = field(default_factory=FusedParams)
    embedding_names: List[str] = field(default_factory=list)
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not self.embedding_names:
            self.embedding_names = list(self.config.feature_names)

    @property
    def row_dtype(self) -> torch.dtype:
        """The dtype of the rows its lookup returns."""
        return self.output_dtype or torch.float32

    @property
    def kernel(self) -> EmbeddingComputeKernel:
        return EmbeddingComputeKernel(self.sharding.compute_kernel)

    @property
    def pooling(self) -> PoolingType:
        return getattr(self.config, "pooling", PoolingType.NONE)

    def shards(self) -> List[ShardMetadata]:
        assert self.sharding.shards is not None, self.config.name
        return self.sharding.shards

    def local_table(self, shard_index: int, pooling: PoolingType | None = None) -> LocalTable:
        shard = self.shards()[shard_index]
        return LocalTable(
            config=self.config,
            rows=shard.shard_sizes[0],
            cols=shard.shard_sizes[1],
            row_offset=shard.shard_offsets[0],
            col_offset=shard.shard_offsets[1],
            compute_kernel=self.kernel,
            pooling=self.pooling if pooling is None else pooling,
            fused_params=self.fused_params,
            shard_index=shard_index,
            embedding_names=self.embedding_names,
        )

    def whole_table(self) -> LocalTable:
        """The full table as one local shard (data-parallel replicas)."""
        c = self.config
        return LocalTable(
            c,
            c.num_embeddings,
            c.embedding_dim,
            0,
            0,
            self.kernel,
            self.pooling,
            self.fused_params,
            embedding_names=self.embedding_names,
        )


def with_embedding_names(specs: List[TableSpec]) -> List[TableSpec]:
    """A collection's table specs with each feature's embedding name: the feature, or
    `feature@table` when several of these tables read it (the unsharded module's output keys)."""
    names = iter(embedding_names([s.config for s in specs]))
    return [
        dataclasses.replace(s, embedding_names=[next(names) for _ in s.config.feature_names])
        for s in specs
    ]


class EmbeddingSharding(nn.Module, abc.ABC):
    """One sharding type's part of a sharded collection.

    `input_features`: the embedding names this sharding reads, in the order it wants them
    (wire order). `output_columns`: what each column of the output-dist result holds, in order.
    """

    input_features: List[str]
    output_columns: OutputColumns
    lookup: Lookup
    carries_input_error = True  # its input dist starts with a splits exchange

    def __init__(self, env: ShardingEnv) -> None:
        super().__init__()
        self.env = env

    def create_context(self) -> EmbeddingShardingContext:
        """A fresh context for one batch."""
        return EmbeddingShardingContext()

    def set_checked_rows(self, rows: Dict[str, int]) -> None:
        """The input dist checks that every id of these embedding names lies in `[0, rows)`
        before `input_dist`: a sharding that sends ids can send them in fewer bytes
        (`KJTAllToAll.set_id_rows`). Nothing to do for one that sends none."""

    @abc.abstractmethod
    def input_dist(
        self, features: KeyedJaggedTensor, ctx: EmbeddingShardingContext, input_error: str | None
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Route this rank's ids (`features` in wire order) to the ranks that own them."""

    def input_dist_in_order(
        self, features: KeyedJaggedTensor, key_order: List[int], ctx: EmbeddingShardingContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]] | None:
        """`input_dist(features.permute(key_order), ctx, None)` without permuting the ids
        first, or None where this sharding cannot (the caller permutes then)."""
        return None

    def compute(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """Local lookup. The result always joins autograd when gradients are on: a rank that
        holds nothing for this sharding must still run the output dist's backward collective,
        or its peers wait for it forever."""
        local = self.lookup(features)
        if torch.is_grad_enabled() and not local.requires_grad:
            local = local.detach().requires_grad_()
        return local

    @abc.abstractmethod
    def output_dist(
        self, local: torch.Tensor, ctx: EmbeddingShardingContext
    ) -> Awaitable[torch.Tensor]:
        """Bring looked-up embeddings back to the data-parallel layout `[B_local, cols]`."""

    def after_init(self) -> None:
        """Called once the shards hold their initial weights."""

    def local_shards(self) -> List[Tuple[LocalTable, torch.Tensor]]:
        """This rank's shards with their weights (views of the kernel storage)."""
        return list(zip(self.lookup.tables, self.lookup.table_weights()))


def mean_divisor_columns(
    output_columns: OutputColumns,
    mean_features: List[str],
    lengths_per_feature: Dict[str, torch.Tensor],
) -> torch.Tensor | None:
    """`[B, cols]` divisors that turn summed MEAN features into means (1 elsewhere), or None.

    Row-wise shardings split a bag over ranks, so they pool with SUM and divide afterwards.
    """
    if not mean_features:
        return None
    mean = set(mean_features)
    first = next(iter(lengths_per_feature.values()))
    batch, device = first.numel(), first.device
    blocks = []
    for feature, _, width in output_columns:
        if feature in mean:
            blocks.append(
                lengths_per_feature[feature]
                .clamp(min=1)
                .to(torch.float32)
                .unsqueeze(1)
                .expand(batch, width)
            )
        else:
            blocks.append(torch.ones(batch, width, device=device))
    return torch.cat(blocks, dim=1)


def mean_divisor_blocks(
    output_columns: OutputColumns,
    batch_sizes: List[int],
    mean_features: List[str],
    lengths_per_feature: Dict[str, torch.Tensor],
) -> torch.Tensor:
    """The flat divisors of a variable batch per feature's pooled blocks (for each entry of
    `output_columns`, `batch_sizes[i]` rows of its width): bag sizes of MEAN features
    (`lengths_per_feature[f]`, `[B_f]`), 1 elsewhere."""
    mean = set(mean_features)
    device = next(iter(lengths_per_feature.values())).device
    blocks = []
    for (feature, _, width), batch in zip(output_columns, batch_sizes):
        if feature in mean:
            lengths = lengths_per_feature[feature]
            blocks.append(lengths.clamp(min=1).to(torch.float32).repeat_interleave(width))
        else:
            blocks.append(torch.ones(batch * width, device=device))
    return torch.cat(blocks)
