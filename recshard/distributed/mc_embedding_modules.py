"""Sharded managed collision collections: a ShardedManagedCollisionCollection in front of a
sharded EBC/EC whose row-split tables are cut at bucket boundaries (one row-wise sharding) and
whose column-split tables keep their plan (the placed shardings).

forward = input_dist (check, hash, route raw ids to the ranks owning their buckets: one KJT
all-to-all; a column-split table's ids to each of its column shards through the placed
sharding's own all-to-all) -> compute (remap there to local rows, reset the rows given to new
ids — weights re-drawn by the table's init, fused optimizer state zeroed, on every column
shard: `recshard.distributed.mc_reset` — then the sharded collection's local lookups) ->
output_dist (the sharded collection's). The sharded collection's own input dist is never used.

Equals the unsharded `ManagedCollision*Collection` with the same buckets, step for step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from recshard.comm import SequenceEmbeddingsAllToAll
from recshard.distributed.input_dist import EmbeddingModuleContext, placeholder_kjt
from recshard.distributed.mc_layout import modules_for_world
from recshard.distributed.mc_modules import (
    ColumnDist,
    ManagedCollisionCollectionSharder,
    mcc_module_of,
)
from recshard.distributed.mc_reset import reset_evicted
from recshard.distributed.module_state import EmbeddingModuleSharder, ShardedEmbeddingModule
from recshard.distributed.sharded_state import entry_sharded_tensor, row_sharded_tensor
from recshard.lookup.fused_params import FusedOptimSpec
from recshard.lookup.tables import LocalTable
from recshard.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
from recshard.sparse import KeyedJaggedTensor
from recshard.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    FnAwaitable,
    LazyAwaitable,
    ModuleSharder,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)


@dataclass
class ManagedCollisionEmbeddingContext:
    """One batch's state from input_dist to output_dist."""

    embedding: EmbeddingModuleContext  # its `features`: the checked, hashed batch (wire order)
    evictions_per_table: Dict[str, torch.Tensor | None] = field(default_factory=dict)
    # return_remapped_features: where this rank's ids went, the ids' all-to-all (its splits),
    # what arrived here and their global rows
    sent_to: torch.Tensor | None = None
    a2a: Any = None
    received_lengths: torch.Tensor | None = None
    global_rows: torch.Tensor | None = None

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.embedding.record_stream(stream)


class _WithRemapped(LazyAwaitable[Tuple[Any, KeyedJaggedTensor | None]]):
    """`(embeddings, remapped features or None)`, as the unsharded module returns."""

    def __init__(
        self,
        embeddings: LazyAwaitable[Any],
        remapped: Callable[[], KeyedJaggedTensor] | None,
    ) -> None:
        super().__init__()
        self._embeddings, self._remapped = embeddings, remapped

    def _wait_impl(self) -> Tuple[Any, KeyedJaggedTensor | None]:
        remapped = self._remapped() if self._remapped is not None else None
        return self._embeddings.wait(), remapped


class _AllAwaitable(Awaitable[List[KeyedJaggedTensor]]):
    """Each sharding's routed ids, in order."""

    def __init__(self, awaitables: List[Awaitable[KeyedJaggedTensor]]) -> None:
        super().__init__()
        self._awaitables = awaitables

    def _wait_impl(self) -> List[KeyedJaggedTensor]:
        return [a.wait() for a in self._awaitables]


class BaseShardedManagedCollisionEmbeddingCollection(ShardedModule):
    """The sharded twin of `ManagedCollisionEmbedding(Bag)Collection` (row-wise tables)."""

    def __init__(
        self,
        module: BaseManagedCollisionEmbeddingCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None,
        e_sharder: EmbeddingModuleSharder,
        mc_sharder: ManagedCollisionCollectionSharder,
    ) -> None:
        super().__init__()
        device = torch.device(device or "cpu")
        mcc = module._managed_collision_collection
        configs = mcc.embedding_configs()
        modules = modules_for_world(mcc, table_plans, env.world_size)
        plans = mc_sharder.bucket_aligned_plans(
            modules, table_plans, {c.name: c.embedding_dim for c in configs}, env, device.type
        )
        self._embedding_module: ShardedEmbeddingModule = e_sharder.shard(
            module._embedding_module, plans, env, device
        )
        # one row-wise sharding (every bucket-aligned table) and placed ones (column-split)
        self._sharding_names = list(self._embedding_module.shardings)
        shardings = self._embedding_module.shardings
        rows = [n for n in shardings if n.startswith("row_wise")]
        if len(rows) > 1:
            raise ValueError(
                f"{type(module).__name__}: its row-wise, table-wise and table-row-wise tables "
                f"must share one embedding dim and dtype here (shardings {rows})"
            )
        self._row_name = rows[0] if rows else None
        self._placed_names = [n for n in shardings if n.startswith("placed")]
        wire = list(shardings[rows[0]].input_features) if rows else []
        column = list(
            dict.fromkeys(f for n in self._placed_names for f in shardings[n].input_features)
        )
        if column and module._return_remapped_features:
            raise ValueError(
                f"{type(module).__name__}: return_remapped_features is not supported with "
                f"column-wise / table-column-wise tables (features {column})"
            )
        if column:  # raw ids cross: below input_hash_size, not the table's rows
            for name in self._placed_names:
                shardings[name].set_checked_rows(
                    {f: mcc_module_of(mcc, f).input_size() for f in column}
                )
        self._managed_collision_collection = mc_sharder.shard(
            mcc,
            modules,
            env,
            device,
            wire,
            bool(getattr(module, "is_weighted", lambda: False)()),
            table_plans,
            column,
        )
        self._column_first = {  # a column-split table's first rank
            t: min(s.rank for s in p.shards or [])
            for t, p in plans.items()
            if p.sharding_type in ("column_wise", "table_column_wise")
        }
        self._arrival_order = ([self._row_name] if rows else []) + self._placed_names
        self._configs = {c.name: c for c in configs}
        self._return_remapped_features = module._return_remapped_features
        if self._return_remapped_features:  # every feature on the wire (no column tables)
            self._rows_back = SequenceEmbeddingsAllToAll(
                env.pg, [len(wire)] * env.world_size, device
            )
            self._remapped_order = [wire.index(f) for f in mcc.feature_names()]

    def create_context(self) -> ManagedCollisionEmbeddingContext:
        return ManagedCollisionEmbeddingContext(self._embedding_module.create_context())

    def _sharding_ctx(self, ctx: ManagedCollisionEmbeddingContext, name: str) -> Any:
        return ctx.embedding.sharding_contexts[self._sharding_names.index(name)]

    def _column_dist(self, ctx: ManagedCollisionEmbeddingContext, name: str) -> ColumnDist:
        """A placed sharding's own routing of the column features' hashed ids (each to every
        column shard), or of a rejected batch's verdict."""
        placed = self._embedding_module.shardings[name]
        placed_ctx = self._sharding_ctx(ctx, name)
        wanted = list(placed.input_features)

        def dist(column: KeyedJaggedTensor | None, error: str | None) -> Any:
            if column is None:
                column = placeholder_kjt(wanted, self._managed_collision_collection._device)
            else:
                keys = column.keys()
                column = column.permute([keys.index(f) for f in wanted])
            return placed.input_dist(column, placed_ctx, error)

        return dist

    def input_dist(
        self, ctx: ManagedCollisionEmbeddingContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[List[KeyedJaggedTensor]]]:
        column_dists = [self._column_dist(ctx, name) for name in self._placed_names]
        hashed, sent_to, pending = self._managed_collision_collection.input_dist(
            features, column_dists
        )
        ctx.embedding.features = hashed
        ctx.sent_to = sent_to
        row_ctx = None
        if self._row_name is not None:
            row_ctx = self._sharding_ctx(ctx, self._row_name)
            self._before_send(row_ctx, hashed, sent_to)

        def start_tensors() -> Awaitable[List[KeyedJaggedTensor]]:
            tensors = [p.wait() for p in pending]
            if row_ctx is not None:
                ctx.a2a = tensors[0]
                self._after_splits(row_ctx, tensors[0])
            return _AllAwaitable(tensors)

        return FnAwaitable(start_tensors)

    def _before_send(
        self, sharding_ctx: Any, features: KeyedJaggedTensor, sent_to: torch.Tensor
    ) -> None:
        """Fill what the sharding's output dist reads from its own input dist (the routed
        batch is `features`, its ids moved to positions `sent_to`)."""

    def _after_splits(self, sharding_ctx: Any, tensors: Any) -> None:
        """Keep what the sharding's output dist needs from the splits exchange."""

    def _on_arrival(self, sharding_ctx: Any, received: KeyedJaggedTensor) -> None:
        """Keep what the sharding's output dist needs from the received ids."""

    def compute(
        self, ctx: ManagedCollisionEmbeddingContext, dist_input: List[KeyedJaggedTensor]
    ) -> List[torch.Tensor]:
        """`dist_input`: the ids routed here, one KJT per sharding (row-wise first)."""
        if self._row_name is not None:
            self._on_arrival(self._sharding_ctx(ctx, self._row_name), dist_input[0])
        local, evictions = self._managed_collision_collection.remap(dist_input)
        if self._return_remapped_features:
            ctx.received_lengths = dist_input[0].lengths()
            ctx.global_rows = self._managed_collision_collection.global_rows(local[0])
        self._reset(evictions)
        ctx.evictions_per_table = evictions
        by_name = dict(zip(self._arrival_order, local))
        return self._embedding_module.compute(
            ctx.embedding, [by_name[n] for n in self._sharding_names]
        )

    def output_dist(
        self, ctx: ManagedCollisionEmbeddingContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[Tuple[Any, KeyedJaggedTensor | None]]:
        embeddings = self._embedding_module.output_dist(ctx.embedding, output)
        if not self._return_remapped_features:
            return _WithRemapped(embeddings, None)
        return _WithRemapped(embeddings, self._send_rows_back(ctx))

    def _send_rows_back(self, ctx: ManagedCollisionEmbeddingContext) -> Callable[[], Any]:
        """Start sending each received id's global row back to the rank it came from (the
        ids' all-to-all reversed, as the sequence output); returns the wait giving this rank's
        remapped KJT (the unsharded module's keys, lengths and weights)."""
        assert ctx.global_rows is not None and ctx.embedding.features is not None
        a2a, features = ctx.a2a, ctx.embedding.features
        with torch.no_grad():
            pending = self._rows_back(
                ctx.global_rows.unsqueeze(1),
                ctx.received_lengths,
                a2a.input_splits["values"],
                a2a.output_splits["values"],
                unbucketize_permute_tensor=ctx.sent_to,
                batch_size_per_rank=a2a.stride_per_rank,
                sparse_features_recat=a2a.recat,
            )

        def remapped() -> KeyedJaggedTensor:
            rows = pending.wait().squeeze(1)
            wire = KeyedJaggedTensor(
                features.keys(),
                rows,
                features.weights_or_none(),
                lengths=features.lengths(),
                stride=features.stride(),
                validate=False,
            )
            return wire.permute(self._remapped_order)

        return remapped

    # ---------------------------------------------------------------- state
    # The tables' state is the sharded collection's, under `_embedding_module.`; the managed
    # collision buffers are row-sharded like the tables (bucket-aligned), under the unsharded
    # keys, so checkpoints reshard them to any world size with every id keeping its row.

    @property
    def env(self) -> ShardingEnv:
        return self._embedding_module.env

    def table_key(self, table: str) -> str:
        return f"_embedding_module.{self._embedding_module.table_key(table)}"

    def table_configs(self) -> List[Any]:
        return self._embedding_module.table_configs()

    def table_plan(self, table: str) -> ParameterSharding:
        return self._embedding_module.table_plan(table)

    def local_table_shards(self) -> Dict[str, List[Tuple[LocalTable, torch.Tensor]]]:
        return self._embedding_module.local_table_shards()

    def load_full_tables(self, full: Dict[str, torch.Tensor]) -> None:
        self._embedding_module.load_full_tables(full)

    def local_scale_bias(self) -> Dict[str, List[Tuple[LocalTable, torch.Tensor]]]:
        return self._embedding_module.local_scale_bias()

    def load_full_quantized(
        self, full: Dict[str, Tuple[torch.Tensor, torch.Tensor | None]]
    ) -> None:
        self._embedding_module.load_full_quantized(full)

    def fused_optim_spec(self, table: str) -> FusedOptimSpec:
        return self._embedding_module.fused_optim_spec(table)

    def fused_optimizer_states(self) -> Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]]:
        return self._embedding_module.fused_optimizer_states()

    def sharded_buffer_state(self, prefix: str) -> Dict[str, Any]:
        """Row-indexed buffers cut like their tables; the histories (entries) concatenated
        over the ranks, their lengths exchanged here (collective: every rank calls it)."""
        out: Dict[str, Any] = {}
        env = self.env
        head = f"{prefix}_managed_collision_collection._managed_collision_modules"
        modules = self._managed_collision_collection.local_modules()
        lengths = torch.tensor(
            [  # a column-split table's history: its first replica's
                m.history_length() if self._column_first.get(t, env.rank) == env.rank else 0
                for t, m in modules.items()
            ],
            dtype=torch.int64,
            device=self._managed_collision_collection._device,
        )
        every = [lengths]
        if env.world_size > 1:
            every = [torch.empty_like(lengths) for _ in range(env.world_size)]
            dist.all_gather(every, lengths, group=env.pg)
        for index, (table, module) in enumerate(modules.items()):
            shards = [
                (s.shard_offsets[0], s.shard_sizes[0], s.rank)
                for s in self.table_plan(table).shards or []
                if s.shard_sizes[0] > 0  # ranks without rows of the table hold no shard
            ]
            if self._column_first.get(table) is not None:  # replicas: the first one saves
                shards = [(0, module.output_size(), self._column_first[table])]
            history = module.history_names()
            for name, buffer in module.named_buffers(recurse=False):
                key = f"{head}.{table}.{name}"
                if name in history:
                    sizes = [int(e[index]) for e in every]
                    out[key] = entry_sharded_tensor(buffer, sizes, env.rank, env.pg)
                elif name != "_current_iter_tensor":  # indexed by row: cut like the table
                    out[key] = row_sharded_tensor(
                        buffer, module.output_size(), shards, env.rank, env.pg
                    )
                else:
                    out[key] = buffer.detach()
        return out

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """The tables' local weights under their unsharded names (the sharded collection's)."""
        head = f"{prefix}._embedding_module" if prefix else "_embedding_module"
        yield from self._embedding_module.named_parameters(head, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        """This rank's managed collision buffers (its rows), under their unsharded names."""
        head = (
            f"{prefix}._managed_collision_collection" if prefix else "_managed_collision_collection"
        )
        yield from self._managed_collision_collection.named_buffers(head, recurse, remove_duplicate)

    def _reset(self, evictions: Dict[str, torch.Tensor | None]) -> None:
        """Rows given to new ids (local rows): weights re-drawn by the table's init, fused
        optimizer state zeroed (`recshard.distributed.mc_reset`)."""
        if not any(rows is not None and rows.numel() for rows in evictions.values()):
            return
        reset_evicted(
            evictions,
            self._embedding_module.local_table_shards(),
            self._embedding_module.fused_optimizer_states(),
            self._configs,
        )


class BaseManagedCollisionEmbeddingCollectionSharder(ModuleSharder[Any]):
    """An embedding sharder and a managed collision sharder composed; plans row-wise only."""

    sharded_type: type

    def __init__(
        self,
        e_sharder: EmbeddingModuleSharder,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(e_sharder.fused_params, qcomm_codecs_registry)
        self._e_sharder = e_sharder
        self._mc_sharder = mc_sharder or ManagedCollisionCollectionSharder()

    def sharding_types(self, compute_device_type: str) -> List[str]:
        """The managed collision sharder's types if the tables can be sharded row-wise: every
        one runs as a row-wise plan cut at bucket boundaries (`bucket_aligned_plan`)."""
        if ShardingType.ROW_WISE.value not in self._e_sharder.sharding_types(compute_device_type):
            return []
        return self._mc_sharder.sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return self._e_sharder.compute_kernels(ShardingType.ROW_WISE.value, compute_device_type)

    def shardable_parameters(
        self, module: BaseManagedCollisionEmbeddingCollection
    ) -> Dict[str, Any]:
        return self._e_sharder.shardable_parameters(module._embedding_module)

    def shard(
        self,
        module: BaseManagedCollisionEmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> BaseShardedManagedCollisionEmbeddingCollection:
        return self.sharded_type(module, params, env, device, self._e_sharder, self._mc_sharder)
