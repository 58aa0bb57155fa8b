"""Table-wise, column-wise and table-column-wise sharding: whole-row shards placed on ranks.

A table-wise table is one shard holding every row and column; a column-wise table is several
shards, each holding every row and a range of columns, and each shard is looked up like a
table of its own. Both route a feature's ids whole to every rank that holds one of its shards
(a feature with k column shards is sent k times), look up `[B_global, local cols]`, and send
the pooled columns back with one all-to-all. Table-column-wise differs only in placement
(shards inside one node), which the plan decides.

A variable batch per feature (VBE) travels the same way; its pooled rows come back with the
variable-batch all-to-all (`VariableBatchPooledEmbeddingsAllToAll`): flat, for each feature in
`output_columns` order, this rank's batch of that feature.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from recshard.comm import (
    KJTAllToAll,
    PooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsAllToAll,
)
from recshard.comm.column_blocks import cut_at_chunks
from recshard.lookup.grouped import GroupedLookup, lookup_order
from recshard.lookup.tables import LocalTable
from recshard.sharding.common import (
    EmbeddingSharding,
    EmbeddingShardingContext,
    LookupFactory,
    TableSpec,
)
from recshard.sparse import KeyedJaggedTensor
from recshard.types import Awaitable, ShardingEnv


class PlacedPooledSharding(EmbeddingSharding):
    """TW / CW / TWCW for pooled (EmbeddingBagCollection) tables."""

    def __init__(
        self,
        specs: List[TableSpec],
        env: ShardingEnv,
        device: torch.device,
        is_weighted: bool,
        codecs: Any | None = None,
        make_lookup: LookupFactory = GroupedLookup,
    ) -> None:
        super().__init__(env)
        per_rank: List[List[LocalTable]] = [[] for _ in range(env.world_size)]
        for spec in specs:
            for index, shard in enumerate(spec.shards()):
                per_rank[shard.rank].append(spec.local_table(index))
        ordered = [lookup_order(tables, is_weighted) for tables in per_rank]
        self.input_features = [f for tables in ordered for t in tables for f in t.embedding_names]
        self.output_columns = [
            (f, t.col_offset, t.cols)
            for tables in ordered
            for t in tables
            for f in t.embedding_names
        ]
        features_per_rank = [sum(t.num_features for t in tables) for tables in ordered]
        dim_sum_per_rank = [sum(t.cols * t.num_features for t in tables) for tables in ordered]
        self.lookup = make_lookup(ordered[env.rank], True, device, is_weighted)
        self._kjt_a2a = KJTAllToAll(env.pg, features_per_rank)
        self._dim_sum_per_rank = dim_sum_per_rank
        self._pooled_a2a = PooledEmbeddingsAllToAll(env.pg, dim_sum_per_rank, device, codecs=codecs)
        self._variable_batch_a2a = VariableBatchPooledEmbeddingsAllToAll(
            env.pg,
            [[t.cols for t in tables for _ in t.embedding_names] for tables in ordered],
            device,
            codecs=codecs,
        )

    def take_column_order(self, spans: Sequence[Sequence[int]]) -> bool:
        """Deliver the output columns as these (start, width) spans of `output_columns`, in
        this order, straight from the pooled all-to-all's receive buffer."""
        self._pooled_a2a.set_column_order(cut_at_chunks(spans, self._dim_sum_per_rank))
        return True

    def set_checked_rows(self, rows: Dict[str, int]) -> None:
        self._kjt_a2a.set_id_rows([rows.get(f) for f in self.input_features])

    def input_dist(
        self, features: KeyedJaggedTensor, ctx: EmbeddingShardingContext, input_error: str | None
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return self._kjt_a2a(features, input_error=input_error)

    def input_dist_in_order(
        self, features: KeyedJaggedTensor, key_order: List[int], ctx: EmbeddingShardingContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]] | None:
        """The KJT all-to-all's pack reads each key's ids where they lie (a column-wise
        feature goes to every rank with a shard: the permute would copy its ids once each)."""
        return self._kjt_a2a(features, key_order=key_order)

    def output_dist(
        self, local: torch.Tensor, ctx: EmbeddingShardingContext
    ) -> Awaitable[torch.Tensor]:
        if ctx.variable_batch_per_feature:
            return self._variable_batch_a2a(
                local, ctx.batch_size_per_rank_per_feature, ctx.batch_size_per_feature_pre_a2a
            )
        return self._pooled_a2a(local, batch_size_per_rank=ctx.batch_size_per_rank)
