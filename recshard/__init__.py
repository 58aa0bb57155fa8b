"""recshard: shard the embedding tables of recommender models and train them fast.

Subpackages (`recshard.distributed`, `recshard.optim`, `recshard.planner`, ...) are reachable
as attributes after `import recshard`, imported on first use so `import recshard` stays light.
"""

import importlib
from types import ModuleType

from recshard.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
)
from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recshard.types import (
    BoundsCheckMode,
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
)

_SUBPACKAGES = frozenset(
    {
        "checkpoint",
        "comm",
        "datasets",
        "distributed",
        "fx",
        "lookup",
        "models",
        "modules",
        "optim",
        "parallel",
        "plan",
        "planner",
        "port",
        "quant",
        "sharding",
        "sparse",
    }
)


def __getattr__(name: str) -> ModuleType:
    """`recshard.<subpackage>` without importing it first (as `import torchrec` allows)."""
    if name in _SUBPACKAGES:
        return importlib.import_module(f"recshard.{name}")
    raise AttributeError(f"module 'recshard' has no attribute '{name}'")


__all__ = [
    "BoundsCheckMode",
    "DataType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingComputeKernel",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "ParameterSharding",
    "PoolingType",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
]
