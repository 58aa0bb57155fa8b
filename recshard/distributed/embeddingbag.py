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
from recshard.modules.input_checks import check_dtypes_and_weights, check_features, check_ids
from recshard.sharding.build import build_pooled_shardings
from recshard.sharding.common import EmbeddingSharding, TableSpec
from recshard.sparse import KeyedJaggedTensor, KeyedTensor
from recshard.sparse.validation import validate_kjt
from recshard.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    FnAwaitable,
    LazyAwaitable,
    ShardedModule,
    ShardingEnv,
)


class _ListAwaitable(Awaitable[List[Any]]):
    """Waits a list of awaitables; the result of each wait may itself be an awaitable."""

    def __init__(self, awaitables: List[Awaitable[Any]]) -> None:
        super().__init__()
        self._awaitables = awaitables

    def _wait_impl(self) -> List[Any]:
        return [a.wait() for a in self._awaitables]


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
        self._feature_to_table = {f: (c.name, c.num_embeddings) for c in configs for f in c.feature_names}
        specs = [TableSpec(c, table_plans[c.name], dict(fused_params or {})) for c in configs]
        self._shardings: Dict[str, EmbeddingSharding] = build_pooled_shardings(
            specs, env, self._device, self._is_weighted, qcomm_codecs_registry
        )
        for name, sharding in self._shardings.items():
            self.add_module(f"sharding_{name}", sharding)
        self._wire_features = [f for s in self._shardings.values() for f in s.input_features]
        self._wire_splits = [len(s.input_features) for s in self._shardings.values()]
        self._column_order = self._output_permutation()
        self._permute_cache: Dict[Tuple[str, ...], torch.Tensor] = {}
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

    def _wire_permutation(self, keys: List[str]) -> torch.Tensor:
        cached = self._permute_cache.get(tuple(keys))
        if cached is None:
            index = {k: i for i, k in enumerate(keys)}
            cached = torch.tensor([index[f] for f in self._wire_features], dtype=torch.int32)
            self._permute_cache[tuple(keys)] = cached
        return cached

    # ---------------------------------------------------------------- sharded module steps

    def create_context(self) -> Dict[str, Any]:
        return {}

    def _reject_reason(self, features: KeyedJaggedTensor) -> Optional[str]:
        owner = "ShardedEmbeddingBagCollection"
        try:
            validate_kjt(features)
            check_features(features, self._feature_names, owner)
            check_dtypes_and_weights(features, self._is_weighted, owner)
            check_ids(features, self._feature_to_table, owner)
        except ValueError as e:
            return str(e)
        return None

    def input_dist(self, ctx: Dict[str, Any], features: KeyedJaggedTensor) -> Awaitable[Awaitable[List[KeyedJaggedTensor]]]:
        """Check the batch, permute it into wire order once, start every sharding's dist.

        A rejected batch still takes part in the splits exchange, carrying the verdict, so
        every rank raises at the first wait instead of hanging in a collective.
        """
        error = self._reject_reason(features)
        if error is None:
            wired = features.permute(self._wire_permutation(features.keys()).tolist(),
                                     self._wire_permutation(features.keys()).to(features.device))
            parts = wired.split(self._wire_splits)
        else:
            if not any(s.carries_input_error for s in self._shardings.values()):
                raise ValueError(error)
            parts = [_placeholder(s.input_features, features) for s in self._shardings.values()]
        awaitables = [s.input_dist(part, ctx, error) for s, part in zip(self._shardings.values(), parts)]
        splits = _ListAwaitable(awaitables)

        def start_tensors() -> Awaitable[List[KeyedJaggedTensor]]:
            tensors = splits.wait()
            # every rank's batch size, learned in the splits exchange (unequal batches work)
            sizes = next((t.stride_per_rank for t in tensors if hasattr(t, "stride_per_rank")), None)
            if sizes is not None and len(set(sizes)) > 1:
                ctx["batch_size_per_rank"] = list(sizes)
            return _ListAwaitable(tensors)

        return FnAwaitable(start_tensors)

    def compute(self, ctx: Dict[str, Any], dist_input: List[KeyedJaggedTensor]) -> List[torch.Tensor]:
        return [s.compute(kjt) for s, kjt in zip(self._shardings.values(), dist_input)]

    def output_dist(self, ctx: Dict[str, Any], output: List[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        pending = [s.output_dist(local, ctx) for s, local in zip(self._shardings.values(), output)]
        return _KeyedTensorAwaitable(pending, self)

    def embedding_bag_configs(self):  # noqa: ANN201 - mirrors the unsharded module
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted


def _placeholder(keys: List[str], like: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """An empty batch with the wire keys: lets a rejecting rank join the splits exchange."""
    return KeyedJaggedTensor(
        keys, torch.empty(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int32),
        stride=0, validate=False,
    )
