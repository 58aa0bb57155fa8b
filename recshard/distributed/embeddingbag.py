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
from recshard.distributed.plan_checks import check_module_plan
from recshard.distributed.pooled_output import PooledOutputMixin
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.sharding.build import build_pooled_shardings
from recshard.sharding.common import EmbeddingSharding, TableSpec
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
        self.env = env
        self._device = torch.device(device or "cpu")
        configs = module.embedding_bag_configs()
        check_module_plan(configs, table_plans, env, "EmbeddingBagCollection", pooled=True)
        self._is_weighted = module.is_weighted()
        self._configs = configs
        self._table_plans = dict(table_plans)
        self._fused_params = dict(fused_params or {})
        self._feature_names = [f for c in configs for f in c.feature_names]
        self._feature_dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        specs = [TableSpec(c, table_plans[c.name], dict(fused_params or {})) for c in configs]
        self._shardings: Dict[str, EmbeddingSharding] = build_pooled_shardings(
            specs, env, self._device, self._is_weighted, qcomm_codecs_registry
        )
        for name, sharding in self._shardings.items():
            self.add_module(f"sharding_{name}", sharding)
        self._init_input_side()
        self._block_permute = self._output_permute()
        self._init_from(module)
