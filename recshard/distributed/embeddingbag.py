"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection whose tables live on many ranks.

forward = input_dist (route ids, two-stage all-to-all) -> compute (fused lookups) ->
output_dist (pooled all-to-all / reduce-scatter), each step asynchronous. The output
`KeyedTensor` keeps the unsharded module's key order (TorchRec reorders by sharding type).

Gradient convention (as TorchRec's default): a table's update uses the mean over ranks of the
per-rank gradients, `W -= lr * (1/world_size) * sum_r grad_r`, for model-parallel and
data-parallel tables alike: the output dists divide gradients by the world size in backward
(`recshard.comm.set_gradient_division`), replicated tables are averaged like DDP.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from recshard.distributed.module_state import ShardedTablesMixin
from recshard.distributed.pooled_output import PooledOutputMixin
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.sharding.build import build_pooled_shardings
from recshard.types import (
    EmbeddingModuleShardingPlan,
    ShardedModule,
    ShardingEnv,
)


class ShardedEmbeddingBagCollection(PooledOutputMixin, ShardedTablesMixin, ShardedModule):
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
        super().__init__()
        self._init_collection(module.embedding_bag_configs(), table_plans, env, device, fused_params,
                              pooled=True, is_weighted=module.is_weighted(),
                              what="EmbeddingBagCollection")
        self._adopt_shardings(build_pooled_shardings(
            self._table_specs(module), env, self._device, self._is_weighted, qcomm_codecs_registry))
        self._column_blocks = self._output_order()
        self._init_from(module)
