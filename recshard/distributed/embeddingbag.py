"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection whose tables live on many ranks,
and its sharder.

forward = input_dist (route ids, two-stage all-to-all) -> compute (fused lookups) ->
output_dist (pooled all-to-all / reduce-scatter), each step asynchronous. The output
`KeyedTensor` keeps the unsharded module's key order (TorchRec reorders by sharding type).

Gradient convention (as TorchRec's default): a table's update uses the mean over ranks of the
per-rank gradients, `W -= lr * (1/world_size) * sum_r grad_r`, for model-parallel and
data-parallel tables alike: the output dists divide gradients by the world size in backward
(`recshard.comm.set_gradient_division`), replicated tables are averaged like DDP.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.distributed.module_state import ShardedEmbeddingModule
from recshard.distributed.pooled_output import PooledOutputLayout, pooled_output_dist
from recshard.modules.embedding_configs import EmbeddingBagConfig
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.plan.sharding_types import supported_compute_kernels
from recshard.sharding.build import build_pooled_shardings
from recshard.sparse import KeyedJaggedTensor, KeyedTensor
from recshard.types import (
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ModuleSharder,
    ShardingEnv,
    ShardingType,
)


class ShardedEmbeddingBagCollection(ShardedEmbeddingModule):
    """Sharded twin of `EmbeddingBagCollection`, built by `EmbeddingBagCollectionSharder`."""

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__("ShardedEmbeddingBagCollection", "EmbeddingBagCollection", "embedding_bags",
                         module.embedding_bag_configs(), table_plans, env, device, fused_params,
                         pooled=True, is_weighted=module.is_weighted())
        self.set_shardings(build_pooled_shardings(
            self.table_specs(module), env, self._device, self._is_weighted, qcomm_codecs_registry))
        self._layout = PooledOutputLayout(
            list(self.shardings.values()), self._embedding_names, self._embedding_dims)
        self.init_from(module)

    def compute(
        self, ctx: EmbeddingModuleContext, dist_input: List[KeyedJaggedTensor]
    ) -> List[torch.Tensor]:
        """Each sharding's local lookups (fused kernels) on the ids routed to this rank."""
        return [s.compute(kjt) for s, kjt in zip(self.shardings.values(), dist_input)]

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        """Pooled rows back to the ranks that own the batch, in the module's key order."""
        return pooled_output_dist(list(self.shardings.values()), self._layout, ctx, output)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted


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
