"""Sharded modules, their sharders, manual plans, DistributedModelParallel."""

import sys

from recshard.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from recshard.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recshard.distributed.mc_embedding import (
    ManagedCollisionEmbeddingCollectionSharder,
    ShardedManagedCollisionEmbeddingCollection,
)
from recshard.distributed.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from recshard.distributed.mc_modules import (
    ManagedCollisionCollectionSharder,
    ShardedManagedCollisionCollection,
)
from recshard.distributed.model_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DistributedModelParallel,
    default_sharders,
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
from recshard.distributed.sharded_embedding_bag import EmbeddingBagSharder, ShardedEmbeddingBag
from recshard.distributed.train_pipeline import (
    EvalPipelineSparseDist,
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineContext,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
)
from recshard.plan import manual as sharding_plan
from recshard.types import ShardingEnv

# TorchRec's import path for the manual plan helpers, which live in recshard.plan.manual
sys.modules[f"{__name__}.sharding_plan"] = sharding_plan

__all__ = [
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "DistributedModelParallel",
    "EmbeddingBagCollectionSharder",
    "EmbeddingBagSharder",
    "EmbeddingCollectionSharder",
    "ManagedCollisionCollectionSharder",
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ManagedCollisionEmbeddingCollectionSharder",
    "QuantEmbeddingBagCollectionSharder",
    "QuantEmbeddingCollectionSharder",
    "ShardedQuantEmbeddingBagCollection",
    "ShardedQuantEmbeddingCollection",
    "ShardedEmbeddingCollection",
    "ShardedEmbeddingBag",
    "ShardedEmbeddingBagCollection",
    "ShardedManagedCollisionCollection",
    "ShardedManagedCollisionEmbeddingBagCollection",
    "ShardedManagedCollisionEmbeddingCollection",
    "ShardingEnv",
    "EvalPipelineSparseDist",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "default_sharders",
    "get_module",
    "get_unwrapped_module",
]
