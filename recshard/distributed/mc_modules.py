"""ShardedManagedCollisionCollection: raw ids routed to the rank that owns their rows and
remapped there, so a raw id crosses the network once.

Layout at world size W (`recshard.distributed.mc_layout`): a table's module has B >= W buckets
(`recshard.modules.mc_modules`); rank r owns buckets `[r*B//W, (r+1)*B//W)` and exactly their
rows (a row-wise shard cut at bucket boundaries, so any zch size works).

Column-wise and table-column-wise tables keep their plan: every rank holding one of a table's
column shards holds a replica of its whole module (all buckets) and remaps the ids the column
sharding's own all-to-all brings it (the global batch's, the same on each replica, so the
replicas evolve alike).

input_dist: check the batch (features, dtypes, ids inside `input_hash_size` after the hash)
on every rank, hash, route each id to `owner[id % B]` (one KJT all-to-all; a rejected batch
sends its verdict instead, so every rank raises). compute: count and remap the received ids
with this rank's slice of each module (the global batch's ids of its buckets, as the unsharded
module sees them), return local rows and the rows given to new ids.

On CPU the id check, the routing and the remap run in C++ (`recshard.distributed.mc_native`:
each module's ids in a hash that an eviction updates in place), so does every module's count
of a step's ids (one call: `recshard.distributed.mc_native_record`), and the modules evicting
at a step whose policy is LFU without a threshold filter evict in one C++ call; elsewhere, or
without the library, in torch ops (`recshard.modules.mc_fused`). Both give the same rows.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from recshard.comm import KJTAllToAll
from recshard.distributed import mc_library, mc_native
from recshard.distributed.input_dist import placeholder_kjt
from recshard.distributed.mc_layout import (
    MC_SHARDING_TYPES,
    bucket_aligned_plan,
    bucket_ranges,
    counted_key_tables,
    holding_ranks,
    is_column_split,
)
from recshard.distributed.mc_native_record import NativeFusedRecord
from recshard.modules.input_checks import check_dtypes_and_weights, check_features, check_one_batch
from recshard.modules.mc_fused import FusedRemap
from recshard.modules.mc_modules import (
    ManagedCollisionCollection,
    ManagedCollisionModule,
    MCHManagedCollisionModule,
)
from recshard.plan.sharding_types import sharding_type_values
from recshard.sparse import JaggedTensor, KeyedJaggedTensor
from recshard.sparse.validation import validate_kjt
from recshard.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
)

# (hashed ids of the column features, or None with a rejected batch's reason) -> the started
# all-to-all of the column-split tables' sharding
ColumnDist = Callable[
    [KeyedJaggedTensor | None, str | None], Awaitable[Awaitable[KeyedJaggedTensor]]
]


def mcc_table(mcc: ManagedCollisionCollection, feature: str) -> str:
    """The table `feature` reads."""
    return next(c.name for c in mcc.embedding_configs() if feature in c.feature_names)


def mcc_module_of(mcc: ManagedCollisionCollection, feature: str) -> ManagedCollisionModule:
    """The managed collision module of the table `feature` reads."""
    return mcc.modules_by_table()[mcc_table(mcc, feature)]


def route_to_owners(
    features: KeyedJaggedTensor, owner: torch.Tensor, world: int
) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
    """Every bag cut into one bag per destination rank (`owner [N]`), destination-major keys
    (`keys * world`), ids kept in order within a bag: the layout `KJTAllToAll` sends. Also
    where each id went (`[N]`: position in the routed values, fbgemm's unbucketize permute)."""
    lengths = features.lengths()
    bags = lengths.numel()
    bag_of_id = torch.repeat_interleave(torch.arange(bags, device=lengths.device), lengths.long())
    order = torch.argsort(owner, stable=True)
    routed_lengths = torch.bincount(owner * bags + bag_of_id, minlength=world * bags)
    weights = features.weights_or_none()
    routed = KeyedJaggedTensor(
        features.keys() * world,
        features.values().index_select(0, order),
        weights.index_select(0, order) if weights is not None else None,
        lengths=routed_lengths.to(lengths.dtype),
        stride=features.stride(),
        validate=False,
    )
    sent_to = torch.empty_like(order)
    sent_to[order] = torch.arange(order.numel(), device=order.device)
    return routed, sent_to


class ShardedManagedCollisionCollection(nn.Module):
    """This rank's slice of every table's module, and the id routing to it."""

    def __init__(
        self,
        modules: Dict[str, MCHManagedCollisionModule],
        mcc: ManagedCollisionCollection,
        env: ShardingEnv,
        device: torch.device,
        wire_features: List[str],
        is_weighted: bool,
        ranges: Dict[str, List[Tuple[int, int]]],
        column_features: List[str] | None = None,
    ) -> None:
        """`wire_features`: the features this collection routes (row-wise, bucket-aligned
        tables); `column_features`: those of column-split tables, whose ids the embedding
        module's own sharding sends to each column shard, remapped there by a replica of the
        table's module. `ranges`: per table, the buckets `[first, last)` of every rank."""
        super().__init__()
        self._column_features = list(column_features or [])
        column_tables = {mcc_table(mcc, f) for f in self._column_features}
        self.env, self._device = env, device
        self._owner = "ShardedManagedCollisionCollection"
        self._is_weighted = is_weighted
        world, rank = env.world_size, env.rank
        self._managed_collision_modules = nn.ModuleDict(
            {t: m.rebuild_with_bucket_range(*ranges[t][rank], device) for t, m in modules.items()}
        )
        for table in column_tables:  # a replica: every rank of it holds the whole state
            self._managed_collision_modules[table].replicated = bool(  # type: ignore[union-attr]
                ranges[table][rank][1] > ranges[table][rank][0]
            )
        self._feature_names = mcc.feature_names()
        self._feature_to_table = {
            f: c.name for c in mcc.embedding_configs() for f in c.feature_names
        }
        self._wire_features = wire_features
        modules_list = list(self._managed_collision_modules.values())
        tables = list(self._managed_collision_modules)
        self._table_index = {t: k for k, t in enumerate(tables)}
        self._module_of_feature = {
            f: self._table_index[t] for f, t in self._feature_to_table.items()
        }
        wire_tables = [self._table_index[self._feature_to_table[f]] for f in wire_features]
        self._wire_tables = torch.tensor(wire_tables, dtype=torch.int64, device=device)
        self._hash_sizes = torch.tensor(
            [m.input_size() for m in modules_list], dtype=torch.int64, device=device
        )
        self._buckets = torch.tensor([m.buckets() for m in modules_list], device=device)
        # owner rank of every bucket of every table, tables one after another
        owner_of_bucket = [
            [r for r, (first, last) in enumerate(ranges[t]) for _ in range(first, last)]
            if t not in column_tables
            else [0] * modules[t].buckets()  # never routed by this collection
            for t in tables
        ]
        self._owner_of_bucket = torch.tensor(
            [r for owners in owner_of_bucket for r in owners], dtype=torch.int64, device=device
        )
        self._first_owner = torch.tensor(
            [0] + [len(owners) for owners in owner_of_bucket[:-1]],
            dtype=torch.int64,
            device=device,
        ).cumsum(0)
        self._checked_features = wire_features + self._column_features
        self._checked_tables = torch.tensor(
            [self._table_index[self._feature_to_table[f]] for f in self._checked_features],
            dtype=torch.int64,
            device=device,
        )
        self._hashed_features = {
            f for f in self._checked_features if self._table_of(f)._input_hash_func is not None
        }
        self._native = mc_library.enabled(device)
        self._remapper: FusedRemap | mc_native.NativeFusedRemap
        self._recorder: NativeFusedRecord | None = None
        if self._native:  # each module's ids in a C++ hash, read by one C++ remap call
            for module in modules_list:
                module.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
            self._remapper = mc_native.NativeFusedRemap(modules_list)
            self._recorder = NativeFusedRecord(modules_list, self._module_of_feature)
        else:
            self._remapper = FusedRemap(modules_list, device)
        self._key_tables: Dict[Tuple[str, ...], torch.Tensor] = {}
        self._row_offsets = torch.tensor(
            [m.row_range()[0] for m in modules_list], dtype=torch.int64, device=device
        )
        self._kjt_a2a = None
        if wire_features:  # ids travel in the narrowest type below their input_hash_size
            self._kjt_a2a = KJTAllToAll(env.pg, [len(wire_features)] * world)
            self._kjt_a2a.set_id_rows(
                [self._table_of(f).input_size() for f in wire_features] * world
            )

    def local_modules(self) -> Dict[str, MCHManagedCollisionModule]:
        return dict(self._managed_collision_modules.items())  # type: ignore[arg-type]

    def _table_of(self, feature: str) -> MCHManagedCollisionModule:
        return self._managed_collision_modules[self._feature_to_table[feature]]  # type: ignore

    def _tables_of_keys(self, keys: List[str]) -> torch.Tensor:
        """Module index of each key `[K]` (cached per key list: the same every step)."""
        index = self._key_tables.get(tuple(keys))
        if index is None:
            index = torch.tensor(
                [self._table_index[self._feature_to_table[k]] for k in keys],
                dtype=torch.int64,
                device=self._wire_tables.device,
            )
            self._key_tables[tuple(keys)] = index
        return index

    def _tables_of_ids(self, keys: List[str], lengths_per_key: List[int]) -> torch.Tensor:
        """Module index of each id `[N]` of a KJT with these keys."""
        counts = torch.tensor(lengths_per_key, dtype=torch.int64, device=self._device)
        return torch.repeat_interleave(
            self._tables_of_keys(keys), counts, output_size=sum(lengths_per_key)
        )

    def _ids_in_range(self, ids: torch.Tensor, per_key: List[int]) -> bool:
        """Whether every id `[N]` of the checked features lies in its table's input range."""
        if self._native:
            lengths = torch.tensor(per_key, dtype=torch.int64, device="cpu")
            return mc_native.ids_in_range(ids, self._checked_tables, lengths, self._hash_sizes)
        tables = self._tables_of_ids(self._checked_features, per_key)
        sizes = self._hash_sizes.index_select(0, tables)
        return not (ids.numel() and bool(((ids < 0) | (ids >= sizes)).any()))

    def _route(self, wire: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
        """`wire` (the wire features' hashed ids) routed to their owners, and where each id
        went (see `route_to_owners`)."""
        world = self.env.world_size
        if self._native:
            return mc_native.route(
                wire,
                self._wire_tables,
                self._buckets,
                self._first_owner,
                self._owner_of_bucket,
                world,
            )
        tables = self._tables_of_ids(self._wire_features, wire.length_per_key())
        bucket = wire.values() % self._buckets.index_select(0, tables)
        owners = self._owner_of_bucket.index_select(
            0, self._first_owner.index_select(0, tables) + bucket
        )
        return route_to_owners(wire, owners, world)

    def _local_rows(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Local row `[N]` of each id routed here (the values of one received KJT)."""
        keys, per_key = kjt.keys(), kjt.length_per_key()
        if isinstance(self._remapper, mc_native.NativeFusedRemap):
            lengths = torch.tensor(per_key, dtype=torch.int64, device="cpu")
            return self._remapper.remap(kjt.values(), self._tables_of_keys(keys), lengths)
        return self._remapper.remap(kjt.values(), self._tables_of_ids(keys, per_key))

    def _hashed(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The batch with hashed ids, keys the wire features then the column features;
        ValueError on a bad batch."""
        validate_kjt(features)
        check_features(features, self._feature_names, self._owner)
        check_one_batch(features, self._owner)
        check_dtypes_and_weights(features, self._is_weighted, self._owner)
        keys = features.keys()
        if keys != self._checked_features:
            features = features.permute([keys.index(f) for f in self._checked_features])
        per_key = features.length_per_key()
        ids = features.values().to(torch.int64)
        if self._hashed_features:
            parts = list(ids.split(per_key))
            for k, feature in enumerate(self._checked_features):
                if feature in self._hashed_features:
                    hashed = self._table_of(feature).preprocess(
                        {
                            feature: JaggedTensor(
                                parts[k], lengths=torch.tensor([per_key[k]], device=ids.device)
                            )
                        }
                    )
                    parts[k] = hashed[feature].values()
            ids = torch.cat(parts) if parts else ids
        if not self._ids_in_range(ids, per_key):
            for feature, part in zip(self._checked_features, ids.split(per_key)):
                table = self._feature_to_table[feature]
                self._table_of(feature).check_ids(part, f"table '{table}', feature '{feature}'")
        return KeyedJaggedTensor(
            self._checked_features,
            ids,
            features.weights_or_none(),
            lengths=features.lengths(),
            stride=features.stride(),
            validate=False,
        )

    def input_dist(
        self,
        features: KeyedJaggedTensor,
        column_dists: List[ColumnDist] | None = None,
    ) -> Tuple[KeyedJaggedTensor, torch.Tensor, List[Awaitable[Awaitable[KeyedJaggedTensor]]]]:
        """(the checked batch with hashed ids, wire then column features; where each wire id
        went in the routed values; the started all-to-alls: the wire ids' to their owners,
        then each of `column_dists` with the column features' hashed ids). A bad batch raises
        here on its rank after sending its verdict through each, which makes every other rank
        raise at its first wait."""
        world = self.env.world_size
        try:
            hashed = self._hashed(features)
        except ValueError as e:
            pending = []
            if self._kjt_a2a is not None:
                pending.append(
                    self._kjt_a2a(
                        placeholder_kjt(self._wire_features * world, self._device),
                        input_error=str(e),
                    )
                )
            pending += [dist(None, str(e)) for dist in column_dists or []]
            pending[0].wait()
            raise  # unreachable: the wait raises this rank's own error
        wire, column = hashed, None
        if self._column_features:
            wire, column = hashed.split([len(self._wire_features), len(self._column_features)])
        routed, sent_to = self._route(wire)
        pending = [] if self._kjt_a2a is None else [self._kjt_a2a(routed)]
        pending += [dist(column, None) for dist in column_dists or []]
        return hashed, sent_to, pending

    def remap(
        self, received: List[KeyedJaggedTensor]
    ) -> Tuple[List[KeyedJaggedTensor], Dict[str, torch.Tensor | None]]:
        """Count (training) and remap the ids routed here (the KJTs of `input_dist`'s
        all-to-alls): (local rows in each received layout, per table the local rows given to
        new ids, or None). A column-split table counts each of its features once, however
        many of its column shards this rank holds; one with none here counts the iteration."""
        if self.training:
            due = self._recorder.record(received) if self._recorder else self._record(received)
            self._evict(due)
        local = [
            KeyedJaggedTensor(
                kjt.keys(),
                self._local_rows(kjt),
                kjt.weights_or_none(),
                lengths=kjt.lengths(),
                stride=kjt.stride(),
                validate=False,
            )
            for kjt in received
        ]
        evictions: Dict[str, torch.Tensor | None] = {}
        for table, module in self._managed_collision_modules.items():
            evicted = module.evict()  # type: ignore[operator]
            offset = module.row_range()[0]  # type: ignore[operator]
            evictions[table] = None if evicted is None else evicted - offset
        return local, evictions

    def _record(self, received: List[KeyedJaggedTensor]) -> List[MCHManagedCollisionModule]:
        """Each module's `record` of its ids (see `remap`); the modules whose iteration evicts."""
        tables = counted_key_tables([kjt.keys() for kjt in received], self._module_of_feature)
        chunks = [c for kjt in received for c in kjt.values().split(kjt.length_per_key())]
        per_module: Dict[int, List[torch.Tensor]] = {}
        for table, chunk in zip(tables, chunks):
            if table >= 0:
                per_module.setdefault(table, []).append(chunk)
        none = torch.empty(0, dtype=torch.int64, device=self._device)
        due = []
        for table, module in enumerate(self._managed_collision_modules.values()):
            # every module counts the iteration, those of tables with no ids here too
            parts = per_module.get(table, [none])
            if module.record(torch.cat(parts) if len(parts) > 1 else parts[0]):  # type: ignore
                due.append(module)
        return due  # type: ignore[return-value]

    def _evict(self, modules: List[MCHManagedCollisionModule]) -> None:
        """The evictions of the modules whose iteration evicts: those that a C++ index runs
        whole (LFU without a threshold filter) all in one call (`mc_native.evict_lfu_tables`),
        the others each on its own, in order."""
        batch = []
        for module in modules:
            in_one_call = module.lfu_eviction() if self._native else None
            if in_one_call is not None and isinstance(in_one_call[0], mc_native.NativeIdIndex):
                batch.append((module, in_one_call))
            else:
                module.run_eviction()
        if batch:
            results = mc_native.evict_lfu_tables([in_one_call for _, in_one_call in batch])
            for (module, _), (rows, evicted) in zip(batch, results):
                module.lfu_evicted(rows, evicted)

    def global_rows(self, local: KeyedJaggedTensor) -> torch.Tensor:
        """The table rows `[N]` of `remap`'s local rows (its output KJT)."""
        tables = self._tables_of_ids(local.keys(), local.length_per_key())
        return local.values() + self._row_offsets.index_select(0, tables)


class ManagedCollisionCollectionSharder:
    """Shards a ManagedCollisionCollection next to its embedding tables (row-wise)."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return sorted(sharding_type_values(MC_SHARDING_TYPES))

    def shard(
        self,
        module: ManagedCollisionCollection,
        modules: Dict[str, MCHManagedCollisionModule],
        env: ShardingEnv,
        device: torch.device,
        wire_features: List[str],
        is_weighted: bool,
        table_plans: EmbeddingModuleShardingPlan,
        column_features: List[str] | None = None,
    ) -> ShardedManagedCollisionCollection:
        ranges = {
            t: bucket_ranges(
                m.buckets(),
                holding_ranks(t, table_plans.get(t), env.world_size),
                env.world_size,
                is_column_split(table_plans.get(t)),
            )
            for t, m in modules.items()
        }
        return ShardedManagedCollisionCollection(
            modules, module, env, device, wire_features, is_weighted, ranges, column_features
        )

    def bucket_aligned_plans(
        self,
        modules: Dict[str, MCHManagedCollisionModule],
        table_plans: EmbeddingModuleShardingPlan,
        dims: Dict[str, int],
        env: ShardingEnv,
        device_type: str,
    ) -> Dict[str, ParameterSharding]:
        return {
            t: table_plans[t]
            if is_column_split(table_plans.get(t))
            else bucket_aligned_plan(t, table_plans.get(t), m, dims[t], env.world_size, device_type)
            for t, m in modules.items()
        }
