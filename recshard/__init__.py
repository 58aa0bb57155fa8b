"""recshard: shard the embedding tables of recommender models and train them fast."""

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
