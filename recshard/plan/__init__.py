"""What a sharding plan is, in one place: its types, how a table's rows and columns are cut
(`geometry`), the per-table helpers that build one by hand (`manual`), which sharding types
go together (`sharding_types`), and the one validator every consumer calls (`validate`).

`ParameterSharding`, `ShardingPlan` and `ShardMetadata` are defined in `recshard.types` (their
TorchRec import path) and re-exported here; `recshard.distributed.sharding_plan` is the
TorchRec path of `recshard.plan.manual`.
"""

from recshard.plan.geometry import column_wise_sizes, make_shards, row_block_size, row_wise_sizes
from recshard.plan.manual import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recshard.plan.validate import (
    PlanValidationError,
    check_module_plan,
    check_table_plan,
    validate_plan,
)
from recshard.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardMetadata,
)

__all__ = [
    "EmbeddingModuleShardingPlan",
    "ParameterSharding",
    "PlanValidationError",
    "ShardMetadata",
    "ShardingPlan",
    "check_module_plan",
    "check_table_plan",
    "column_wise",
    "column_wise_sizes",
    "construct_module_sharding_plan",
    "data_parallel",
    "make_shards",
    "row_block_size",
    "row_wise",
    "row_wise_sizes",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "validate_plan",
]
