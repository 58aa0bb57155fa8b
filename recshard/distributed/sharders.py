"""Sharders: turn an unsharded collection plus its per-table plan into the sharded module."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from recshard.distributed.embeddingbag import ShardedEmbeddingBagCollection
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.plan.sharding_types import supported_compute_kernels
from recshard.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardingEnv,
    ShardingType,
)


class EmbeddingBagCollectionSharder(ModuleSharder[EmbeddingBagCollection]):
    """All six sharding types on CPU and CUDA (row-wise included: gloo reduce-scatters)."""

    @property
    def module_type(self) -> type:
        return EmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [t.value for t in ShardingType]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return supported_compute_kernels(sharding_type, compute_device_type)

    def shardable_parameters(self, module: EmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        return {name: bag.weight for name, bag in module.embedding_bags.items()}

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedEmbeddingBagCollection:
        return ShardedEmbeddingBagCollection(
            module, params, env, device, self.fused_params, self.qcomm_codecs_registry
        )

