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

from typing import Any, Dict, List

import torch
from torch import nn

from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.distributed.module_state import EmbeddingModuleSharder, ShardedEmbeddingModule
from recshard.distributed.pooled_output import PooledOutputLayout, pooled_output_dist
from recshard.distributed.variable_batch_output import VariableBatchOutput
from recshard.modules.embedding_configs import EmbeddingBagConfig
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.sharding.build import build_pooled_shardings
from recshard.sparse import KeyedTensor
from recshard.types import (
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ShardingEnv,
    ShardingType,
)

# TorchRec's name for the sharded EBC's per-batch context (input_dist -> output_dist)
EmbeddingBagCollectionContext = EmbeddingModuleContext


class ShardedEmbeddingBagCollection(ShardedEmbeddingModule):
    """Sharded twin of `EmbeddingBagCollection`, built by `EmbeddingBagCollectionSharder`.

    Takes a variable batch per feature (`stride_per_key_per_rank`, `inverse_indices`) under
    every sharding type, as the unsharded module does (`variable_batch_output.py`)."""

    takes_variable_batch = True

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        fused_params: Dict[str, Any] | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            module,
            "embedding_bags",
            module.embedding_bag_configs(),
            table_plans,
            env,
            device,
            fused_params,
            pooled=True,
            is_weighted=module.is_weighted(),
        )
        self.set_shardings(
            build_pooled_shardings(
                self.storage.table_specs(self, module),
                env,
                self._device,
                self._is_weighted,
                qcomm_codecs_registry,
                self.storage.make_lookup,
            )
        )
        self._layout = PooledOutputLayout(
            list(self.shardings.values()), self._embedding_names, self._embedding_dims
        )
        self._variable_batch = (
            VariableBatchOutput(
                list(self.shardings.values()),
                self._embedding_names,
                [f for c in self._configs for f in c.feature_names],
            )
            if self.takes_variable_batch
            else None
        )
        self.storage.load(self, module)

    # input_dist, compute: `ShardedEmbeddingModule`'s

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        """Pooled rows back to the ranks that own the batch, in the module's key order."""
        return pooled_output_dist(
            list(self.shardings.values()), self._layout, ctx, output, self._variable_batch
        )

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted


class EmbeddingBagCollectionSharder(EmbeddingModuleSharder):
    """All six sharding types on CPU and CUDA (row-wise included: gloo reduce-scatters)."""

    sharded_type = ShardedEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [t.value for t in ShardingType]

    @property
    def module_type(self) -> type:
        return EmbeddingBagCollection

    def shardable_parameters(self, module: EmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        return {name: bag.weight for name, bag in module.embedding_bags.items()}
