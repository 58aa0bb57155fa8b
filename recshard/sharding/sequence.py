"""Sequence (unpooled) shardings for EmbeddingCollection: one embedding row per id.

The routing of ids is the pooled shardings' (`placed.py`, `row_wise.py`); what differs is the
way back. A sequence sharding looks up `[N_recv, D]` (one row per id it received) and the
`SequenceEmbeddingsAllToAll` reverses the ids' all-to-all, so each rank gets `[N_sent, D]`:
one row per id it sent, in the order it sent them. Row-wise shardings bucketize with
`sequence=True` and apply the unbucketize permutation afterwards, restoring the order of the
ids before bucketization.

One sequence all-to-all moves rows of one width and dtype, so TorchRec requires every table
of an EmbeddingCollection to share one dim. recshard instead builds one sharding per
(sharding kind, row width, dtype): a collection with dims 4 and 8 runs two all-to-alls per
kind, and the column shards of a table split unevenly (widths 3, 3, 2) travel in the
all-to-all of their own width. Data-parallel tables are grouped the same way, because a
sequence lookup stacks the rows of all its tables into one `[N, D]` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from recshard.comm import KJTAllToAll, SequenceEmbeddingsAllToAll
from recshard.comm.codecs import CommOp, QuantizedCommCodecs, codecs_from_registry
from recshard.lookup.grouped import GroupedLookup, lookup_order
from recshard.lookup.tables import LocalTable
from recshard.plan.geometry import row_block_size
from recshard.plan.sharding_types import PLACED_TYPES
from recshard.sharding.common import (
    EmbeddingSharding,
    EmbeddingShardingContext,
    LookupFactory,
    TableSpec,
    with_embedding_names,
)
from recshard.sharding.data_parallel import DataParallelPooledSharding
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from recshard.types import Awaitable, ShardingEnv, ShardingType


@dataclass
class SequenceShardingContext(EmbeddingShardingContext):
    """What a sequence sharding's output dist needs from its input dist (TorchRec's name)."""

    a2a: Any = None  # the KJT all-to-all's tensors awaitable: its splits, recat, batch sizes
    received_lengths: torch.Tensor | None = None  # lengths of the ids this rank received
    unbucketize_permute: torch.Tensor | None = None  # row-wise: bucketized -> sent id order

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for tensor in (self.received_lengths, self.unbucketize_permute):
            if tensor is not None and tensor.is_cuda:
                tensor.record_stream(stream)


class _SequenceSharding(EmbeddingSharding):
    """Shared by the model-parallel sequence shardings: KJT all-to-all of ids, lookup of
    `[N_recv, width]`, sequence all-to-all back. Subclasses set `input_features`,
    `output_columns` and `lookup`, call `_make_dists`, and may route ids in `_route`."""

    def __init__(
        self,
        env: ShardingEnv,
        name: str,
        width: int,
        dtype: torch.dtype,
        codecs: QuantizedCommCodecs | None,
    ) -> None:
        super().__init__(env)
        self.name, self.width, self.dtype, self._codecs = name, width, dtype, codecs

    def _make_dists(self, features_per_rank: List[int]) -> None:
        self._kjt_a2a = KJTAllToAll(self.env.pg, features_per_rank)
        self._seq_a2a = SequenceEmbeddingsAllToAll(
            self.env.pg, features_per_rank, codecs=self._codecs
        )

    def create_context(self) -> SequenceShardingContext:
        return SequenceShardingContext()

    def set_checked_rows(self, rows: Dict[str, int]) -> None:
        self._kjt_a2a.set_id_rows(self._routed_rows(rows))

    def _routed_rows(self, rows: Dict[str, int]) -> List[int | None]:
        """Per key of the routed KJT, the rows its checked ids lie in (None: unchecked)."""
        return [rows.get(f) for f in self.input_features]

    def _route(
        self, features: KeyedJaggedTensor, ctx: SequenceShardingContext
    ) -> KeyedJaggedTensor:
        return features

    def input_dist(
        self, features: KeyedJaggedTensor, ctx: SequenceShardingContext, input_error: str | None
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Send the ids; keep the all-to-all's metadata (splits, recat) and the received
        lengths in `ctx`, for the way back."""
        routed = self._route(features, ctx) if input_error is None else features

        def keep_received(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
            ctx.received_lengths = kjt.lengths()
            return kjt

        def keep_metadata(tensors: Awaitable[KeyedJaggedTensor]) -> Awaitable[KeyedJaggedTensor]:
            ctx.a2a = tensors
            tensors.callbacks.append(keep_received)
            return tensors

        splits = self._kjt_a2a(routed, input_error=input_error)
        splits.callbacks.append(keep_metadata)
        return splits

    def compute(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """`[N_recv, width]`. A rank holding no rows of these tables receives no ids and
        gives `[0, width]` without a lookup (fbgemm 1.8's CPU TBE rejects a kernel whose
        tables are all empty, as a row-wise table with fewer rows than ranks has)."""
        if all(t.rows == 0 for t in self.lookup.tables):
            local = torch.zeros(0, self.width, dtype=self.dtype, device=features.values().device)
            return local.requires_grad_(torch.is_grad_enabled())
        return super().compute(features)

    def output_dist(
        self, local: torch.Tensor, ctx: SequenceShardingContext
    ) -> Awaitable[torch.Tensor]:
        """`[N_recv, width]` -> `[N_sent, width]`, rows in the order this rank sent its ids."""
        a2a = ctx.a2a
        return self._seq_a2a(
            local,
            ctx.received_lengths,
            a2a.input_splits["values"],
            a2a.output_splits["values"],
            unbucketize_permute_tensor=ctx.unbucketize_permute,
            batch_size_per_rank=a2a.stride_per_rank,
            sparse_features_recat=a2a.recat,
        )


class PlacedSequenceSharding(_SequenceSharding):
    """TW / CW shards of one width: a feature goes whole to every rank holding one of its
    shards (once per shard), each shard is looked up as a table of its own."""

    def __init__(
        self,
        shards: List[Tuple[TableSpec, int]],
        env: ShardingEnv,
        device: torch.device,
        name: str,
        width: int,
        dtype: torch.dtype,
        codecs: QuantizedCommCodecs | None = None,
        make_lookup: LookupFactory = GroupedLookup,
    ) -> None:
        super().__init__(env, name, width, dtype, codecs)
        per_rank: List[List[LocalTable]] = [[] for _ in range(env.world_size)]
        for spec, index in shards:
            per_rank[spec.shards()[index].rank].append(spec.local_table(index))
        ordered = [lookup_order(tables, False) for tables in per_rank]
        self.input_features = [f for tables in ordered for t in tables for f in t.embedding_names]
        self.output_columns = [
            (f, t.col_offset, t.cols)
            for tables in ordered
            for t in tables
            for f in t.embedding_names
        ]
        self.lookup = make_lookup(ordered[env.rank], False, device, False)
        self._make_dists([sum(t.num_features for t in tables) for tables in ordered])


class RowWiseSequenceSharding(_SequenceSharding):
    """RW tables of one dim: ids bucketized by row block, bucket r to rank r; the
    unbucketize permutation puts the returned rows back in the original id order."""

    def __init__(
        self,
        specs: List[TableSpec],
        env: ShardingEnv,
        device: torch.device,
        name: str,
        width: int,
        dtype: torch.dtype,
        codecs: QuantizedCommCodecs | None = None,
        make_lookup: LookupFactory = GroupedLookup,
    ) -> None:
        super().__init__(env, name, width, dtype, codecs)
        world = env.world_size
        tables = lookup_order([s.local_table(0) for s in specs], False)
        ordered = [next(s for s in specs if s.config.name == t.name) for t in tables]
        self.input_features = [f for s in ordered for f in s.embedding_names]
        self.output_columns = [(f, 0, width) for f in self.input_features]
        self._block_rows = [
            row_block_size(s.config.num_embeddings, world)
            for s in ordered
            for _ in s.config.feature_names
        ]
        self._block_sizes = torch.tensor(self._block_rows, dtype=torch.int64, device=device)
        self.lookup = make_lookup([s.local_table(env.rank) for s in ordered], False, device, False)
        self._make_dists([len(self.input_features)] * world)

    def _routed_rows(self, rows: Dict[str, int]) -> List[int | None]:
        """A checked id, bucketized, lies in its row block (keys bucket-major)."""
        bucket = [b if f in rows else None for f, b in zip(self.input_features, self._block_rows)]
        return bucket * self.env.world_size

    def _route(
        self, features: KeyedJaggedTensor, ctx: SequenceShardingContext
    ) -> KeyedJaggedTensor:
        """Bucket-major KJT (keys repeated once per rank, ids rebased to the row block)."""
        world = self.env.world_size
        lengths, values, _, _, unbucketize = ops.block_bucketize_sparse_features(
            features.lengths(),
            features.values(),
            False,
            True,
            self._block_sizes.to(features.values().dtype),
            world,
            None,
        )
        ctx.unbucketize_permute = unbucketize
        return KeyedJaggedTensor(
            features.keys() * world,
            values,
            lengths=lengths,
            stride=features.stride(),
            validate=False,
        )


class DataParallelSequenceSharding(DataParallelPooledSharding):
    """Replicated tables of one dim, looked up locally one row per id (TorchRec's DP
    EmbeddingCollection pools instead); gradients averaged over ranks as in pooled DP."""

    def __init__(
        self,
        specs: List[TableSpec],
        env: ShardingEnv,
        device: torch.device,
        name: str,
        make_lookup: LookupFactory = GroupedLookup,
    ) -> None:
        super().__init__(specs, env, device, False, False, make_lookup)
        self.name = name


def _group_name(kind: str, width: int, dtype: torch.dtype, single: bool) -> str:
    return kind if single else f"{kind}_{width}_{str(dtype).replace('torch.', '')}"


def build_sequence_shardings(
    specs: List[TableSpec],
    env: ShardingEnv,
    device: torch.device,
    qcomm_codecs_registry: Dict[str, Any] | None = None,
    make_lookup: LookupFactory = GroupedLookup,
) -> Dict[str, EmbeddingSharding]:
    """Shardings keyed by name: "placed", "row_wise", "data_parallel", each suffixed by
    `_<width>_<dtype>` when the collection has shards of more than one row width or dtype
    (the dtype of the rows the lookups return).

    Every rank builds the same list in the same order (it depends on the plan only).
    """
    groups: Dict[Tuple[str, int, torch.dtype], List[Tuple[TableSpec, int]]] = {}
    for spec in with_embedding_names(specs):
        st = ShardingType(spec.sharding.sharding_type)
        dtype = spec.row_dtype
        if st in PLACED_TYPES:
            for index, shard in enumerate(spec.shards()):
                groups.setdefault(("placed", shard.shard_sizes[1], dtype), []).append((spec, index))
        else:
            groups.setdefault((st.value, spec.config.embedding_dim, dtype), []).append((spec, 0))
    codecs = codecs_from_registry(qcomm_codecs_registry, CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)
    single = len({(width, dtype) for _, width, dtype in groups}) <= 1
    order = {"placed": 0, "row_wise": 1, "data_parallel": 2}
    shardings: Dict[str, EmbeddingSharding] = {}
    for kind, width, dtype in sorted(groups, key=lambda k: (order[k[0]], k[1], str(k[2]))):
        members = groups[(kind, width, dtype)]
        name = _group_name(kind, width, dtype, single)
        if kind == "placed":
            shardings[name] = PlacedSequenceSharding(
                members, env, device, name, width, dtype, codecs, make_lookup
            )
        elif kind == "row_wise":
            shardings[name] = RowWiseSequenceSharding(
                [s for s, _ in members], env, device, name, width, dtype, codecs, make_lookup
            )
        else:
            shardings[name] = DataParallelSequenceSharding(
                [s for s, _ in members], env, device, name, make_lookup
            )
    return shardings
