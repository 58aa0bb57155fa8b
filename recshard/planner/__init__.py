"""Sharding planner: choose how every embedding table is sharded and on which ranks.

`EmbeddingShardingPlanner(topology, batch_size, constraints).plan(module, sharders)` returns
a `ShardingPlan`; `save_plan` / `load_plan` store it as JSON; `recshard-plan` (or
`python -m recshard.planner`) plans from a tables file without a model.
"""

from recshard.planner.enumerator import EmbeddingEnumerator, tables_from_module
from recshard.planner.estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
    StorageReservation,
)
from recshard.planner.partitioners import (
    GreedyPerfPartitioner,
    MemoryBalancedPartitioner,
    NoopPerfModel,
    PartitionResult,
)
from recshard.planner.plan_io import (
    load_plan,
    plan_from_dict,
    plan_to_dict,
    save_plan,
    validate_plan,
)
from recshard.planner.planner import EmbeddingShardingPlanner
from recshard.planner.planner_types import (
    ParameterConstraints,
    Perf,
    PlannerError,
    Shard,
    ShardingOption,
    Storage,
    TableMeta,
    Topology,
)
from recshard.planner.proposers import GreedyProposer, GridSearchProposer, UniformProposer
from recshard.planner.refine import refine_placement
from recshard.planner.stats import EmbeddingStats, PlannerStats

__all__ = [
    "EmbeddingEnumerator",
    "EmbeddingPerfEstimator",
    "EmbeddingShardingPlanner",
    "EmbeddingStats",
    "EmbeddingStorageEstimator",
    "GreedyPerfPartitioner",
    "GreedyProposer",
    "GridSearchProposer",
    "MemoryBalancedPartitioner",
    "NoopPerfModel",
    "ParameterConstraints",
    "PartitionResult",
    "Perf",
    "PlannerError",
    "PlannerStats",
    "Shard",
    "ShardingOption",
    "Storage",
    "StorageReservation",
    "TableMeta",
    "Topology",
    "UniformProposer",
    "load_plan",
    "plan_from_dict",
    "plan_to_dict",
    "refine_placement",
    "save_plan",
    "tables_from_module",
    "validate_plan",
]
