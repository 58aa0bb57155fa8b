"""Row-wise and table-row-wise sharding: each rank holds a block of every table's rows.

Row-wise: the rows of a table are cut into `ceil(rows / W)` blocks, one per rank. Each bag is
bucketized by `id // block` (fbgemm's `block_bucketize_sparse_features`, ids rebased to the
block) and bucket r goes to rank r; every rank pools its part of every bag of the global batch,
and a reduce-scatter sums the partial pools and hands each rank its batch slice.

Table-row-wise: the same inside one node (rows cut over the node's ranks). The partial pools
are reduce-scattered within the node, then exchanged across nodes with an all-to-all among
ranks of equal local rank; rows of the global batch are first reordered so that local rank l
receives the samples of every node's rank l.

MEAN tables are pooled as SUM (a bag is split over ranks) and divided by the bag length after
the output dist.

A variable batch per feature (VBE) is bucketized the same way; the partial pools are flat and
rank-major (`recshard.lookup.variable_batch`), reduce-scattered by rank chunk
(`VariableBatchPooledEmbeddingsReduceScatter`) and, for TWRW across nodes, exchanged with the
variable-batch all-to-all. The result is flat: for each feature in `output_columns` order, this
rank's batch of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch

from recshard.comm import (
    KJTAllToAll,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    VariableBatchPooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsReduceScatter,
)
from recshard.comm.pg import intra_and_cross_node_pg
from recshard.lookup.grouped import GroupedLookup, lookup_order
from recshard.modules.embedding_configs import PoolingType
from recshard.plan.geometry import row_block_size
from recshard.sharding.common import (
    EmbeddingSharding,
    EmbeddingShardingContext,
    LookupFactory,
    TableSpec,
    mean_divisor_blocks,
    mean_divisor_columns,
)
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from recshard.types import Awaitable, FnAwaitable, ShardingEnv


def bucketize(
    features: KeyedJaggedTensor, block_sizes: torch.Tensor, num_buckets: int
) -> KeyedJaggedTensor:
    """Split every bag into `num_buckets` bags by `id // block` (ids rebased); bucket-major keys.
    A variable batch per feature stays one: each bucket holds every bag of every feature."""
    variable = features.variable_stride_per_key()
    strides = features.stride_per_key()
    lengths, values, weights, _, _ = ops.block_bucketize_sparse_features(
        features.lengths(),
        features.values(),
        False,
        False,
        block_sizes.to(features.values().dtype),
        num_buckets,
        features.weights_or_none(),
        torch.tensor(strides, device=features.lengths().device) if variable else None,
        max(strides, default=0) if variable else -1,
    )
    return KeyedJaggedTensor(
        features.keys() * num_buckets,
        values,
        weights,
        lengths=lengths,
        stride=features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() * num_buckets
        if variable
        else None,
        validate=False,
    )


@dataclass
class RowWiseShardingContext(EmbeddingShardingContext):
    """Row-wise also keeps the lengths of its MEAN-pooled features: their partial sums are
    reduced as sums and divided by the bag sizes after the reduce-scatter."""

    mean_lengths: Dict[str, torch.Tensor] = field(default_factory=dict)  # feature -> [B_local]

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for lengths in self.mean_lengths.values():
            if lengths.is_cuda:
                lengths.record_stream(stream)


class RowWisePooledSharding(EmbeddingSharding):
    """RW (over all ranks) or TWRW (over the ranks of each table's node)."""

    def __init__(
        self,
        specs: List[TableSpec],
        env: ShardingEnv,
        device: torch.device,
        is_weighted: bool,
        within_node: bool,
        codecs: Any | None = None,
        cross_codecs: Any | None = None,
        make_lookup: LookupFactory = GroupedLookup,
    ) -> None:
        """`codecs` for the reduce-scatter, `cross_codecs` for TWRW's cross-node all-to-all."""
        super().__init__(env)
        self.group_size = env.local_world_size if within_node else env.world_size
        num_groups = env.world_size // self.group_size
        my_group, my_index = divmod(env.rank, self.group_size)
        # tables per group of ranks (one group for RW, one per node for TWRW), in lookup order
        groups: List[List[TableSpec]] = [[] for _ in range(num_groups)]
        for spec in specs:
            groups[spec.shards()[0].rank // self.group_size].append(spec)
        ordered = []
        for group in groups:
            tables = lookup_order([s.local_table(0, PoolingType.SUM) for s in group], is_weighted)
            ordered.append([next(s for s in group if s.config.name == t.name) for t in tables])
        self._groups = ordered
        self.input_features = [f for group in ordered for s in group for f in s.embedding_names]
        self.output_columns = [
            (f, 0, s.config.embedding_dim)
            for group in ordered
            for s in group
            for f in s.embedding_names
        ]
        self._mean_features = [
            f
            for group in ordered
            for s in group
            if s.pooling == PoolingType.MEAN
            for f in s.embedding_names
        ]
        self._features_per_group = [sum(s.config.num_features for s in g) for g in ordered]
        self._block_rows = [
            [
                row_block_size(s.config.num_embeddings, self.group_size)
                for s in g
                for _ in s.config.feature_names
            ]
            for g in ordered
        ]  # per group, the rows of each feature's row block; on the ids' device below
        self._block_sizes = [
            torch.tensor(rows, dtype=torch.int64, device=device) for rows in self._block_rows
        ]
        self.lookup = make_lookup(
            [s.local_table(my_index, PoolingType.SUM) for s in ordered[my_group]],
            True,
            device,
            is_weighted,
        )
        splits = [n for n in self._features_per_group for _ in range(self.group_size)]
        self._kjt_a2a = KJTAllToAll(env.pg, splits)
        self._dims_per_group = [
            sum(s.config.embedding_dim * s.config.num_features for s in g) for g in ordered
        ]
        if within_node and num_groups > 1:
            intra, cross = intra_and_cross_node_pg(env.pg, env.local_world_size)
        else:
            intra, cross = env.pg, None
        self._reduce_scatter = PooledEmbeddingsReduceScatter(intra, codecs=codecs)
        self._variable_batch_reduce_scatter = VariableBatchPooledEmbeddingsReduceScatter(
            intra, codecs=codecs
        )
        self._dims_per_feature = [
            [s.config.embedding_dim for s in g for _ in s.embedding_names] for g in ordered
        ]
        # TWRW across nodes, VBE: each node's reduced part to its rank of equal local rank
        self._cross_variable_batch_a2a = (
            VariableBatchPooledEmbeddingsAllToAll(
                cross, self._dims_per_feature, device, codecs=cross_codecs
            )
            if cross is not None
            else None
        )
        self._cross_a2a = (
            PooledEmbeddingsAllToAll(cross, self._dims_per_group, device, codecs=cross_codecs)
            if cross is not None
            else None
        )
        self._num_groups = num_groups

    def create_context(self) -> RowWiseShardingContext:
        return RowWiseShardingContext()

    def set_checked_rows(self, rows: Dict[str, int]) -> None:
        """A checked id, bucketized, lies in its row block."""
        per_key: List[int | None] = []
        for group, blocks in zip(self._groups, self._block_rows):
            names = [f for s in group for f in s.embedding_names]
            bucket = [b if f in rows else None for f, b in zip(names, blocks)]
            per_key += bucket * self.group_size
        self._kjt_a2a.set_id_rows(per_key)

    def input_dist(
        self, features: KeyedJaggedTensor, ctx: RowWiseShardingContext, input_error: str | None
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if self._mean_features:
            ctx.mean_lengths = {f: features[f].lengths() for f in self._mean_features}
        if input_error is None:
            parts = features.split(self._features_per_group) if self._num_groups > 1 else [features]
            buckets = [
                bucketize(part, block, self.group_size)
                for part, block in zip(parts, self._block_sizes)
            ]
            routed = KeyedJaggedTensor.concat(buckets) if len(buckets) > 1 else buckets[0]
        else:
            routed = features
        return self._kjt_a2a(routed, input_error=input_error)

    def output_dist(
        self, local: torch.Tensor, ctx: RowWiseShardingContext
    ) -> Awaitable[torch.Tensor]:
        batch_sizes = ctx.batch_size_per_rank
        if ctx.variable_batch_per_feature:
            pending = self._variable_batch_output_dist(local, ctx)
        elif self._cross_a2a is None:
            pending = self._reduce_scatter(local, input_splits=batch_sizes)
        elif batch_sizes is not None:
            raise ValueError(
                f"table-row-wise sharding needs equal batch sizes on every rank, got {batch_sizes} "
                "(use row_wise or table_wise for these tables, or pad the batches)"
            )
        else:
            pending = self._node_reduce_then_exchange(local)
        if not self._mean_features:
            return pending

        def divide() -> torch.Tensor:
            pooled = pending.wait()
            if ctx.variable_batch_per_feature:
                return pooled / mean_divisor_blocks(
                    self.output_columns,
                    ctx.batch_size_per_feature_pre_a2a,
                    self._mean_features,
                    ctx.mean_lengths,
                )
            divisor = mean_divisor_columns(
                self.output_columns, self._mean_features, ctx.mean_lengths
            )
            return pooled / divisor

        return FnAwaitable(divide)

    def _node_reduce_then_exchange(self, local: torch.Tensor) -> Awaitable[torch.Tensor]:
        """TWRW output dist: `[B_global, D_node]` partial pools -> `[B_local, sum D_node]`."""
        world, lws = self.env.world_size, self.group_size
        batch = local.size(0) // world
        # rows of global rank (n, l) first grouped by l, then n: local rank l's RS chunk holds
        # the samples of every node's rank l, in node order.
        order = torch.arange(local.size(0), device=local.device)
        order = order.view(self._num_groups, lws, batch).transpose(0, 1)
        regrouped = local.index_select(0, order.reshape(-1))
        reduced = self._reduce_scatter(regrouped)
        return FnAwaitable(lambda: self._cross_a2a(reduced.wait()).wait())

    def _variable_batch_output_dist(
        self, local: torch.Tensor, ctx: RowWiseShardingContext
    ) -> Awaitable[torch.Tensor]:
        """VBE: flat rank-major partial pools -> this rank's batch of every feature, flat.

        RW (one group of ranks): one reduce-scatter by rank chunk. TWRW across nodes: the
        chunks regrouped so that local rank l's reduce-scatter chunk holds the bags of every
        node's rank l (node order), reduce-scattered inside the node, then each node's part
        sent to its rank l by the variable-batch all-to-all among ranks of equal local rank."""
        batches = ctx.batch_size_per_rank_per_feature  # [W][F of my group]
        my_group = self.env.rank // self.group_size
        dims = self._dims_per_feature[my_group]
        cross_a2a = self._cross_variable_batch_a2a
        if cross_a2a is None:
            return self._variable_batch_reduce_scatter(local, batches, dims)
        lws, nodes = self.group_size, self._num_groups
        order = [n * lws + lr for lr in range(lws) for n in range(nodes)]  # (l, n) -> rank
        sizes = [sum(b * d for b, d in zip(batches[r], dims)) for r in range(len(batches))]
        chunks = local.reshape(-1).split(sizes)
        regrouped = torch.cat([chunks[r] for r in order])
        per_local_rank = [
            [b for n in range(nodes) for b in batches[n * lws + lr]] for lr in range(lws)
        ]
        reduced = self._variable_batch_reduce_scatter(regrouped, per_local_rank, dims * nodes)
        me = self.env.rank % lws
        return FnAwaitable(
            lambda: cross_a2a(
                reduced.wait(),
                [batches[n * lws + me] for n in range(nodes)],
                ctx.batch_size_per_feature_pre_a2a,
            ).wait()
        )
