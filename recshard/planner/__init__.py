"""Sharding planner: choose how every embedding table is sharded and on which ranks.

`EmbeddingShardingPlanner(topology, batch_size, constraints).plan(module, sharders)` returns
a `ShardingPlan`; `save_plan` / `load_plan` store it as JSON; `recshard-plan` (or
`python -m recshard.planner`) plans from a tables file without a model. A `CalibrationProfile`
(measured by `recshard.calibration`) gives `Topology(profile=...)` this machine's costs;
`plan_stats` measures any plan with a neutral yardstick; `explain_table` says why a table got its
option.
"""

from recshard.planner.cost.estimators import EmbeddingPerfEstimator
from recshard.planner.cost.plan_stats import PlanStats, RankLoad, plan_stats
from recshard.planner.cost.reservation import StorageReservation
from recshard.planner.cost.step_model import StepTimePerfModel
from recshard.planner.cost.storage import EmbeddingStorageEstimator
from recshard.planner.placement import PartitionResult
from recshard.planner.plan_io import (
    load_plan,
    plan_from_dict,
    plan_to_dict,
    save_plan,
    validate_plan,
)
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
from recshard.planner.profile import CalibrationProfile, KernelCost, LinkCost, MemoryCost
from recshard.planner.report.explain import Explanation, OptionCost, explain_table
from recshard.planner.search.enumerator import EmbeddingEnumerator, tables_from_module
from recshard.planner.search.partitioners import (
    GreedyPerfPartitioner,
    MemoryBalancedPartitioner,
    NoopPerfModel,
)
from recshard.planner.search.planner import EmbeddingShardingPlanner
from recshard.planner.search.proposers import GreedyProposer, GridSearchProposer, UniformProposer
from recshard.planner.search.refine import refine_placement
from recshard.planner.search.stats import EmbeddingStats, PlannerStats

__all__ = [
    "CalibrationProfile",
    "EmbeddingEnumerator",
    "EmbeddingPerfEstimator",
    "EmbeddingShardingPlanner",
    "EmbeddingStats",
    "EmbeddingStorageEstimator",
    "Explanation",
    "GreedyPerfPartitioner",
    "GreedyProposer",
    "GridSearchProposer",
    "KernelCost",
    "LinkCost",
    "MemoryBalancedPartitioner",
    "MemoryCost",
    "NoopPerfModel",
    "OptionCost",
    "ParameterConstraints",
    "PartitionResult",
    "Perf",
    "PlanStats",
    "PlannerError",
    "PlannerStats",
    "RankLoad",
    "Shard",
    "ShardingOption",
    "Storage",
    "StepTimePerfModel",
    "StorageReservation",
    "TableMeta",
    "Topology",
    "UniformProposer",
    "explain_table",
    "load_plan",
    "plan_from_dict",
    "plan_stats",
    "plan_to_dict",
    "refine_placement",
    "save_plan",
    "tables_from_module",
    "validate_plan",
]
