"""Sharded modules, their sharders, manual plans and (later) DMP and the train pipeline."""

from recshard.distributed.embeddingbag import ShardedEmbeddingBagCollection
from recshard.distributed.sharders import EmbeddingBagCollectionSharder

__all__ = ["EmbeddingBagCollectionSharder", "ShardedEmbeddingBagCollection"]
