"""Shared vocabulary of recshard: sharding types, plans, the sharding environment and awaitables.

Names follow TorchRec so that scripts port by changing imports. Everything here is plain data
or a small protocol; the logic that dispatches on it lives in `recshard.sharding` and
`recshard.distributed`. Every name is importable from `recshard.types`; the submodules group
them: `sharding` (plans and environment), `awaitable`, `module` (sharded module and sharder).
"""

from recshard.types.awaitable import (
    Awaitable,
    FnAwaitable,
    LazyAwaitable,
    LazyNoWait,
    NoWait,
    W,
)
from recshard.types.module import (
    M,
    ModuleSharder,
    NullShardingContext,
    Pipelineable,
    ShardedModule,
)
from recshard.types.sharding import (
    ROW_EXCHANGE_MIN_BYTES,
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    CacheStatistics,
    ComputeKernel,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ParameterStorage,
    PipelineType,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    get_local_size,
)

__all__ = [
    "Awaitable",
    "BoundsCheckMode",
    "CacheAlgorithm",
    "CacheParams",
    "CacheStatistics",
    "ComputeKernel",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "FnAwaitable",
    "LazyAwaitable",
    "LazyNoWait",
    "M",
    "ModuleSharder",
    "NoWait",
    "NullShardingContext",
    "ParameterSharding",
    "ParameterStorage",
    "PipelineType",
    "Pipelineable",
    "ROW_EXCHANGE_MIN_BYTES",
    "ShardMetadata",
    "ShardedModule",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "W",
    "get_local_size",
]
