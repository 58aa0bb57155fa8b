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

from typing import Any, Dict, List, Optional, Tuple

import torch

from recshard.distributed.module_state import ShardedTablesMixin
from recshard.distributed.plan_checks import check_module_plan
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.sharding.build import build_pooled_shardings
from recshard.sharding.common import EmbeddingSharding, TableSpec
from recshard.sparse import KeyedTensor
from recshard.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ShardedModule,
    ShardingEnv,
)


class _KeyedTensorAwaitable(LazyAwaitable[KeyedTensor]):
    """Waits every sharding's output dist and lays the columns out in module key order."""

    def __init__(self, pending: List[Awaitable[torch.Tensor]], module: ShardedEmbeddingBagCollection) -> None:
        super().__init__()
        self._pending = pending
        self._module = module

    def _wait_impl(self) -> KeyedTensor:
        module = self._module
        parts = [p.wait() for p in self._pending]
        values = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if module._column_order is not None:
            values = values.index_select(1, module._column_order.to(values.device))
        return KeyedTensor(module._feature_names, module._feature_dims, values)


class ShardedEmbeddingBagCollection(ShardedTablesMixin, ShardedModule):
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
        self._column_order = self._output_permutation()
        self._init_from(module)

    # ---------------------------------------------------------------- layout

    def _output_permutation(self) -> Optional[torch.Tensor]:
        """Index mapping concatenated sharding columns to the module's feature order."""
        where: Dict[Tuple[str, int], int] = {}
        position = 0
        for sharding in self._shardings.values():
            for feature, col_offset, width in sharding.output_columns:
                for c in range(width):
                    where[(feature, col_offset + c)] = position + c
                position += width
        order = [where[(f, c)] for f, d in zip(self._feature_names, self._feature_dims) for c in range(d)]
        if order == list(range(len(order))):
            return None
        return torch.tensor(order, dtype=torch.long)

    def output_dist(self, ctx: Dict[str, Any], output: List[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        pending = [s.output_dist(local, ctx) for s, local in zip(self._shardings.values(), output)]
        return _KeyedTensorAwaitable(pending, self)

    def embedding_bag_configs(self):  # noqa: ANN201 - mirrors the unsharded module
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

