"""Unsharded embedding modules and table configs."""

from recshard.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from recshard.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

__all__ = [
    "DataType",
    "EmbeddingBagConfig",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "PoolingType",
]
