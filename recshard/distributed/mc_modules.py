"""ShardedManagedCollisionCollection: raw ids routed to the rank that owns their rows and
remapped there, so a raw id crosses the network once.

Layout at world size W: a table's module has B >= W buckets (`recshard.modules.mc_modules`);
rank r owns buckets `[r*B//W, (r+1)*B//W)` and exactly their rows (a row-wise shard cut at
bucket boundaries, so any zch size works). A module built with fewer buckets than ranks
(TorchRec's default `buckets=1`) and no ids yet is rebuilt with W buckets, as TorchRec splits
its module per rank; with ids it is an error (they would change rows).

input_dist: check the batch (features, dtypes, ids inside `input_hash_size` after the hash)
on every rank, hash, route each id to `owner[id % B]` (one KJT all-to-all; a rejected batch
sends its verdict instead, so every rank raises). compute: count and remap the received ids
with this rank's slice of each module (the global batch's ids of its buckets, as the unsharded
module sees them), return local rows and the rows given to new ids.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Tuple

import torch
from torch import nn

from recshard.comm import KJTAllToAll
from recshard.modules.input_checks import check_dtypes_and_weights, check_features, check_one_batch
from recshard.modules.mc_fused import FusedRemap
from recshard.modules.mc_modules import (
    ManagedCollisionCollection,
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

MC_SHARDING_TYPES = [ShardingType.ROW_WISE, ShardingType.TABLE_WISE, ShardingType.TABLE_ROW_WISE]


def owned_buckets(buckets: int, world_size: int, rank: int) -> Tuple[int, int]:
    """Buckets `[first, last)` of `rank`: contiguous, as even as whole buckets allow."""
    return rank * buckets // world_size, (rank + 1) * buckets // world_size


def holding_ranks(table: str, plan: ParameterSharding | None, world_size: int) -> List[int]:
    """The ranks a managed collision table's rows live on, in order: every rank (row-wise),
    the plan's rank (table-wise) or the ranks of its node (table-row-wise)."""
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
    return ranks


def bucket_ranges(buckets: int, ranks: List[int], world_size: int) -> List[Tuple[int, int]]:
    """Buckets `[first, last)` of every rank: split evenly over `ranks` in rank order, none
    elsewhere (an empty range where the previous rank's ends, so the ranges tile in order)."""
    holders = sorted(ranks)
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
        if module.buckets() < holders:
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
        features.values()[order],
        weights[order] if weights is not None else None,
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
    ) -> None:
        """`ranges`: per table, the buckets `[first, last)` of every rank."""
        super().__init__()
        self.env, self._device = env, device
        self._owner = "ShardedManagedCollisionCollection"
        self._is_weighted = is_weighted
        world, rank = env.world_size, env.rank
        self._managed_collision_modules = nn.ModuleDict(
            {t: m.rebuild_with_bucket_range(*ranges[t][rank], device) for t, m in modules.items()}
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
            for t in tables
        ]
        self._owner_of_bucket = torch.tensor(
            [r for owners in owner_of_bucket for r in owners], dtype=torch.int64, device=device
        )
        self._first_owner = (
            torch.tensor([0] + [len(owners) for owners in owner_of_bucket[:-1]], dtype=torch.int64)
            .cumsum(0)
            .to(device)
        )
        self._hashed_features = {
            f for f in wire_features if self._table_of(f)._input_hash_func is not None
        }
        self._remapper = FusedRemap(modules_list, device)
        self._row_offsets = torch.tensor(
            [m.row_range()[0] for m in modules_list], dtype=torch.int64, device=device
        )
        self._kjt_a2a = KJTAllToAll(env.pg, [len(wire_features)] * world)

    def local_modules(self) -> Dict[str, MCHManagedCollisionModule]:
        return dict(self._managed_collision_modules.items())  # type: ignore[arg-type]

    def _table_of(self, feature: str) -> MCHManagedCollisionModule:
        return self._managed_collision_modules[self._feature_to_table[feature]]  # type: ignore

    def _tables_of_ids(self, keys: List[str], lengths_per_key: List[int]) -> torch.Tensor:
        """Module index of each id `[N]` of a KJT with these keys."""
        index = self._wire_tables
        if keys != self._wire_features:
            index = torch.tensor(
                [self._table_index[self._feature_to_table[k]] for k in keys],
                dtype=torch.int64,
                device=self._wire_tables.device,
            )
        counts = torch.tensor(lengths_per_key, device=index.device)
        return torch.repeat_interleave(index, counts, output_size=sum(lengths_per_key))

    def _hashed_and_owners(
        self, features: KeyedJaggedTensor
    ) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
        """The batch in wire order with hashed ids, and each id's owner rank; ValueError on a
        bad batch."""
        validate_kjt(features)
        check_features(features, self._feature_names, self._owner)
        check_one_batch(features, self._owner)
        check_dtypes_and_weights(features, self._is_weighted, self._owner)
        keys = features.keys()
        if keys != self._wire_features:
            features = features.permute([keys.index(f) for f in self._wire_features])
        per_key = features.length_per_key()
        ids = features.values().to(torch.int64)
        if self._hashed_features:
            parts = list(ids.split(per_key))
            for k, feature in enumerate(self._wire_features):
                if feature in self._hashed_features:
                    hashed = self._table_of(feature).preprocess(
                        {feature: JaggedTensor(parts[k], lengths=torch.tensor([per_key[k]]))}
                    )
                    parts[k] = hashed[feature].values()
            ids = torch.cat(parts) if parts else ids
        tables = self._tables_of_ids(self._wire_features, per_key)
        if ids.numel() and bool(((ids < 0) | (ids >= self._hash_sizes[tables])).any()):
            for feature, part in zip(self._wire_features, ids.split(per_key)):
                table = self._feature_to_table[feature]
                self._table_of(feature).check_ids(part, f"table '{table}', feature '{feature}'")
        owners = self._owner_of_bucket[self._first_owner[tables] + ids % self._buckets[tables]]
        hashed_kjt = KeyedJaggedTensor(
            self._wire_features,
            ids,
            features.weights_or_none(),
            lengths=features.lengths(),
            stride=features.stride(),
            validate=False,
        )
        return hashed_kjt, owners

    def input_dist(
        self, features: KeyedJaggedTensor
    ) -> Tuple[KeyedJaggedTensor, torch.Tensor, Awaitable[Awaitable[KeyedJaggedTensor]]]:
        """(the checked batch in wire order, where each of its ids went in the routed values,
        the started all-to-all of its ids to their owners). A bad batch raises here on its rank
        after sending its verdict, which makes every other rank raise at its first wait."""
        try:
            hashed, owners = self._hashed_and_owners(features)
        except ValueError as e:
            empty = KeyedJaggedTensor(
                self._wire_features * self.env.world_size,
                torch.empty(0, dtype=torch.int64),
                lengths=torch.zeros(0, dtype=torch.int32),
                stride=0,
                validate=False,
            )
            self._kjt_a2a(empty, input_error=str(e)).wait()
            raise  # unreachable: the wait raises this rank's own error
        routed, sent_to = route_to_owners(hashed, owners, self.env.world_size)
        return hashed, sent_to, self._kjt_a2a(routed)

    def remap(
        self, received: KeyedJaggedTensor
    ) -> Tuple[KeyedJaggedTensor, Dict[str, torch.Tensor | None]]:
        """Count (training) and remap the ids routed here: (local rows in the received layout,
        per table the local rows given to new ids, or None)."""
        keys, per_key = received.keys(), received.length_per_key()
        ids = received.values()
        if self.training:
            chunks = ids.split(per_key)
            per_table: Dict[str, List[torch.Tensor]] = {}
            for key, chunk in zip(keys, chunks):
                per_table.setdefault(self._feature_to_table[key], []).append(chunk)
            for table, parts in per_table.items():
                module = self._managed_collision_modules[table]
                module.count(torch.cat(parts) if len(parts) > 1 else parts[0])  # type: ignore
        rows = self._remapper.remap(ids, self._tables_of_ids(keys, per_key))
        evictions: Dict[str, torch.Tensor | None] = {}
        for table, module in self._managed_collision_modules.items():
            evicted = module.evict()  # type: ignore[operator]
            offset = module.row_range()[0]  # type: ignore[operator]
            evictions[table] = None if evicted is None else evicted - offset
        local = KeyedJaggedTensor(
            keys,
            rows,
            received.weights_or_none(),
            lengths=received.lengths(),
            stride=received.stride(),
            validate=False,
        )
        return local, evictions

    def global_rows(self, local: KeyedJaggedTensor) -> torch.Tensor:
        """The table rows `[N]` of `remap`'s local rows (its output KJT)."""
        tables = self._tables_of_ids(local.keys(), local.length_per_key())
        return local.values() + self._row_offsets[tables]


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
    ) -> ShardedManagedCollisionCollection:
        ranges = {
            t: bucket_ranges(
                m.buckets(), holding_ranks(t, table_plans.get(t), env.world_size), env.world_size
            )
            for t, m in modules.items()
        }
        return ShardedManagedCollisionCollection(
            modules, module, env, device, wire_features, is_weighted, ranges
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
            t: bucket_aligned_plan(t, table_plans.get(t), m, dims[t], env.world_size, device_type)
            for t, m in modules.items()
        }
