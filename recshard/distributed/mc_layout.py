"""Where a sharded managed collision table's buckets live: the ranks holding a table under
its plan, each rank's contiguous run of buckets, and the row-wise plan cut at those bucket
boundaries that the embedding tables run (any zch size works: shards end where buckets do).

A module built with fewer buckets than the ranks holding its table (TorchRec's default
`buckets=1`) and no ids yet is rebuilt with one bucket per rank, as TorchRec splits its module
per rank; with ids it is an error (they would change rows). Column-wise and table-column-wise
tables keep their plan: each rank of their column shards holds every bucket (a replica).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Sequence, Tuple

from recshard.modules.mc_modules import (
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
    bucket_row_starts,
)
from recshard.plan.sharding_types import sharding_type_values
from recshard.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
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


def counted_key_tables(
    keys: Sequence[Sequence[str]], module_of_feature: Dict[str, int]
) -> List[int]:
    """The module of each key of the KJTs a rank received (`keys`: each KJT's, in order), -1
    for a key an earlier one had: a column-split table's feature arrives once per column shard
    the rank holds, and its ids count once."""
    seen, tables = set(), []
    for key in (k for kjt_keys in keys for k in kjt_keys):
        tables.append(-1 if key in seen else module_of_feature[key])
        seen.add(key)
    return tables
