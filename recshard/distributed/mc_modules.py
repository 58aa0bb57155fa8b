"""ShardedManagedCollisionCollection: raw ids routed to the rank that owns their rows and
remapped there, so a raw id crosses the network once.

Layout at world size W: a table's module has B >= W buckets (`recshard.modules.mc_modules`);
rank r owns buckets `[r*B//W, (r+1)*B//W)` and exactly their rows (a row-wise shard cut at
bucket boundaries, so any zch size works). A module built with fewer buckets than ranks
(TorchRec's default `buckets=1`) and no ids yet is rebuilt with W buckets, as TorchRec splits
its module per rank; with ids it is an error (they would change rows).

Column-wise and table-column-wise tables keep their plan: every rank holding one of a table's
column shards holds a replica of its whole module (all buckets) and remaps the ids the column
sharding's own all-to-all brings it (the global batch's, the same on each replica, so the
replicas evolve alike).

input_dist: check the batch (features, dtypes, ids inside `input_hash_size` after the hash)
on every rank, hash, route each id to `owner[id % B]` (one KJT all-to-all; a rejected batch
sends its verdict instead, so every rank raises). compute: count and remap the received ids
with this rank's slice of each module (the global batch's ids of its buckets, as the unsharded
module sees them), return local rows and the rows given to new ids.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from recshard.comm import KJTAllToAll
from recshard.distributed.input_dist import placeholder_kjt
from recshard.modules.input_checks import check_dtypes_and_weights, check_features, check_one_batch
from recshard.modules.mc_fused import FusedRemap
from recshard.modules.mc_modules import (
    ManagedCollisionCollection,
    ManagedCollisionModule,
    MCHManagedCollisionModule,
    bucket_row_starts,
)
from recshard.plan.sharding_types import sharding_type_values
from recshard.sparse import JaggedTensor, KeyedJaggedTensor
from recshard.sparse.validation import validate_kjt
from recshard.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
    ShardMetadata,
)

logger = logging.getLogger(__name__)

COLUMN_TYPES = [ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE]
MC_SHARDING_TYPES = [
    ShardingType.ROW_WISE,
    ShardingType.TABLE_WISE,
    ShardingType.TABLE_ROW_WISE,
    *COLUMN_TYPES,
]


def is_column_split(plan: ParameterSharding | None) -> bool:
    """A column-wise or table-column-wise plan: the table's module is replicated on the ranks
    of its column shards."""
    return plan is not None and plan.sharding_type in sharding_type_values(COLUMN_TYPES)


def owned_buckets(buckets: int, world_size: int, rank: int) -> Tuple[int, int]:
    """Buckets `[first, last)` of `rank`: contiguous, as even as whole buckets allow."""
    return rank * buckets // world_size, (rank + 1) * buckets // world_size


def holding_ranks(table: str, plan: ParameterSharding | None, world_size: int) -> List[int]:
    """The ranks a managed collision table's rows live on, in order: every rank (row-wise),
    the plan's rank (table-wise), the ranks of its node (table-row-wise) or of its column
    shards (column-wise, table-column-wise)."""
    if plan is None:
        raise ValueError(f"table '{table}': the plan has no entry for this managed collision table")
    if plan.sharding_type not in sharding_type_values(MC_SHARDING_TYPES):
        raise ValueError(
            f"table '{table}': managed collision tables are sharded "
            f"{sorted(sharding_type_values(MC_SHARDING_TYPES))}, the plan says "
            f"'{plan.sharding_type}'"
        )
    ranks = list(plan.ranks or [])
    if not ranks and plan.shards:
        ranks = [s.rank for s in plan.shards]
    if not ranks and plan.sharding_type == ShardingType.ROW_WISE.value:
        ranks = list(range(world_size))
    if not ranks or any(not 0 <= r < world_size for r in ranks):
        raise ValueError(f"table '{table}': the plan places it on ranks {ranks} of {world_size}")
    return sorted(set(ranks)) if is_column_split(plan) else ranks


def bucket_ranges(
    buckets: int, ranks: List[int], world_size: int, replicated: bool = False
) -> List[Tuple[int, int]]:
    """Buckets `[first, last)` of every rank: split evenly over `ranks` in rank order, none
    elsewhere (an empty range where the previous rank's ends, so the ranges tile in order);
    `replicated` (column shards): every bucket on each of `ranks`."""
    holders = sorted(ranks)
    if replicated:
        return [(0, buckets) if r in holders else (buckets, buckets) for r in range(world_size)]
    out, end = [], 0
    for rank in range(world_size):
        if rank in holders:
            first, end = owned_buckets(buckets, len(holders), holders.index(rank))
            out.append((first, end))
        else:
            out.append((end, end))
    return out


def modules_for_world(
    mcc: ManagedCollisionCollection, table_plans: EmbeddingModuleShardingPlan, world_size: int
) -> Dict[str, MCHManagedCollisionModule]:
    """Each table's module with at least as many buckets as ranks holding it (see the module
    doc)."""
    out: Dict[str, MCHManagedCollisionModule] = {}
    for table, module in mcc.modules_by_table().items():
        if not isinstance(module, MCHManagedCollisionModule):
            raise TypeError(
                f"table '{table}': sharded managed collision takes MCHManagedCollisionModule, "
                f"got {type(module).__name__}"
            )
        holders = len(holding_ranks(table, table_plans.get(table), world_size))
        if module.buckets() < holders and not is_column_split(table_plans.get(table)):
            logger.warning(
                "table '%s': managed collision module has %d bucket(s) for %d ranks; rebuilt "
                "with %d buckets (it maps ids as the unsharded module with buckets=%d would)",
                table,
                module.buckets(),
                holders,
                holders,
                holders,
            )
            module = module.rebucketed(holders)
        out[table] = module
    return out


def bucket_aligned_plan(
    table: str,
    plan: ParameterSharding | None,
    module: MCHManagedCollisionModule,
    embedding_dim: int,
    world_size: int,
    device_type: str,
) -> ParameterSharding:
    """The table's plan as the row-wise plan the sharded collection runs: one shard per rank,
    cut at bucket boundaries, empty on ranks that do not hold the table (table-wise: every row
    on its rank; table-row-wise: the rows cut over its node's ranks)."""
    ranges = bucket_ranges(module.buckets(), holding_ranks(table, plan, world_size), world_size)
    assert plan is not None
    starts = bucket_row_starts(module.output_size(), module.buckets())
    shards = [
        ShardMetadata(
            [starts[first], 0],
            [starts[last] - starts[first], embedding_dim],
            f"rank:{rank}/{device_type}",
        )
        for rank, (first, last) in enumerate(ranges)
    ]
    return dataclasses.replace(
        plan,
        sharding_type=ShardingType.ROW_WISE.value,
        ranks=list(range(world_size)),
        shards=shards,
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
        self._remapper = FusedRemap(modules_list, device)
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

    def _tables_of_ids(self, keys: List[str], lengths_per_key: List[int]) -> torch.Tensor:
        """Module index of each id `[N]` of a KJT with these keys."""
        index = self._wire_tables
        if keys == self._checked_features:
            index = self._checked_tables
        elif keys != self._wire_features:
            index = torch.tensor(
                [self._table_index[self._feature_to_table[k]] for k in keys],
                dtype=torch.int64,
                device=self._wire_tables.device,
            )
        counts = torch.tensor(lengths_per_key, dtype=torch.int64, device=index.device)
        return torch.repeat_interleave(index, counts, output_size=sum(lengths_per_key))

    def _hashed_and_owners(
        self, features: KeyedJaggedTensor
    ) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
        """The batch with hashed ids, keys the wire features then the column features, and the
        owner rank of each wire feature's id; ValueError on a bad batch."""
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
        tables = self._tables_of_ids(self._checked_features, per_key)
        if ids.numel() and bool(
            ((ids < 0) | (ids >= self._hash_sizes.index_select(0, tables))).any()
        ):
            for feature, part in zip(self._checked_features, ids.split(per_key)):
                table = self._feature_to_table[feature]
                self._table_of(feature).check_ids(part, f"table '{table}', feature '{feature}'")
        wire = sum(per_key[: len(self._wire_features)])
        tables, wire_ids = tables[:wire], ids[:wire]
        bucket = wire_ids % self._buckets.index_select(0, tables)
        owners = self._owner_of_bucket.index_select(
            0, self._first_owner.index_select(0, tables) + bucket
        )
        hashed_kjt = KeyedJaggedTensor(
            self._checked_features,
            ids,
            features.weights_or_none(),
            lengths=features.lengths(),
            stride=features.stride(),
            validate=False,
        )
        return hashed_kjt, owners

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
            hashed, owners = self._hashed_and_owners(features)
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
        routed, sent_to = route_to_owners(wire, owners, world)
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
            per_table: Dict[str, List[torch.Tensor]] = {}
            seen = set()
            for kjt in received:
                for key, chunk in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())):
                    if key not in seen:
                        seen.add(key)
                        per_table.setdefault(self._feature_to_table[key], []).append(chunk)
            none = torch.empty(0, dtype=torch.int64, device=self._device)
            for table, module in self._managed_collision_modules.items():
                # every module counts the iteration, those of tables with no ids here too
                parts = per_table.get(table, [none])
                module.count(torch.cat(parts) if len(parts) > 1 else parts[0])  # type: ignore
        local = [
            KeyedJaggedTensor(
                kjt.keys(),
                self._remapper.remap(
                    kjt.values(), self._tables_of_ids(kjt.keys(), kjt.length_per_key())
                ),
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
