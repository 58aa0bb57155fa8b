"""Sharded modules, their sharders, manual plans, DistributedModelParallel."""

from recshard.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from recshard.distributed.embeddingbag import ShardedEmbeddingBagCollection
from recshard.distributed.model_parallel import (
    DefaultDataParallelWrapper,
    DistributedModelParallel,
    get_module,
    get_unwrapped_module,
)
from recshard.distributed.quant_embedding import (
    QuantEmbeddingCollectionSharder,
    ShardedQuantEmbeddingCollection,
)
from recshard.distributed.quant_embeddingbag import (
    QuantEmbeddingBagCollectionSharder,
    ShardedQuantEmbeddingBagCollection,
)
from recshard.distributed.sharders import EmbeddingBagCollectionSharder, default_sharders
from recshard.distributed.train_pipeline import (
    EvalPipelineSparseDist,
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineContext,
    TrainPipelineSparseDist,
)
from recshard.types import ShardingEnv

__all__ = [
    "DefaultDataParallelWrapper",
    "DistributedModelParallel",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "QuantEmbeddingBagCollectionSharder",
    "QuantEmbeddingCollectionSharder",
    "ShardedQuantEmbeddingBagCollection",
    "ShardedQuantEmbeddingCollection",
    "ShardedEmbeddingCollection",
    "ShardedEmbeddingBagCollection",
    "ShardingEnv",
    "EvalPipelineSparseDist",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineSparseDist",
    "default_sharders",
    "get_module",
    "get_unwrapped_module",
]
