"""ShardedEmbeddingCollection: an EmbeddingCollection whose tables live on many ranks.

forward = input_dist (the sharded EBC's: check the batch, permute it once into wire order,
route ids with two-stage all-to-alls) -> compute (sequence lookups, one row per id) ->
output_dist (sequence all-to-alls back), each step asynchronous. The result is
`{feature: JaggedTensor}` like the unsharded module's: values `[N_f, D]` in the input's id
order, the input's lengths, keys in the module's feature order, ids as weights when
`need_indices`. Column shards of a feature are joined along dim 1 in column order.

Tables may have different dims (TorchRec requires one): see `recshard/sharding/sequence.py`.
Gradient convention as the sharded EBC: updates use the mean over ranks of the gradients.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from recshard.distributed.module_state import EmbeddingModuleContext, ShardedTablesMixin
from recshard.modules.embedding_modules import EmbeddingCollection
from recshard.plan.sharding_types import (
    SEQUENCE_SHARDING_TYPES,
    sharding_type_values,
    supported_compute_kernels,
)
from recshard.sharding.sequence import build_sequence_shardings
from recshard.sparse import JaggedTensor, KeyedJaggedTensor
from recshard.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ModuleSharder,
    ShardedModule,
    ShardingEnv,
)

# (sharding name, position among its output columns) of every piece of a feature, by column
_Pieces = List[Tuple[str, int]]


class _JaggedDictAwaitable(LazyAwaitable[Dict[str, JaggedTensor]]):
    """Waits every sharding's sequence all-to-all, cuts the rows per feature and joins the
    column shards of each feature."""

    def __init__(
        self,
        pending: Dict[str, Awaitable[torch.Tensor]],
        features: KeyedJaggedTensor,
        module: ShardedEmbeddingCollection,
    ) -> None:
        super().__init__()
        self._pending, self._features, self._module = pending, features, module

    def _wait_impl(self) -> Dict[str, JaggedTensor]:
        module, inputs = self._module, self._features.to_dict()
        ids_per_feature = dict(zip(self._features.keys(), self._features.length_per_key()))
        chunks: Dict[str, List[torch.Tensor]] = {}
        for name, pending in self._pending.items():
            sizes = [ids_per_feature[f] for f in module._shardings[name].input_features]
            chunks[name] = list(pending.wait().split(sizes))
        out: Dict[str, JaggedTensor] = {}
        for feature, pieces in module._pieces.items():
            parts = [chunks[name][k] for name, k in pieces]
            jt = inputs[feature]
            out[feature] = JaggedTensor(
                parts[0] if len(parts) == 1 else torch.cat(parts, dim=1),
                weights=jt.values() if module._need_indices else None,
                lengths=jt.lengths(),
                offsets=jt.offsets(),
            )
        return out


class ShardedEmbeddingCollection(ShardedTablesMixin, ShardedModule):
    """Sharded twin of `EmbeddingCollection` (DP, TW, CW, RW), built by
    `EmbeddingCollectionSharder`."""

    _tables_attr = "embeddings"
    _owner = "ShardedEmbeddingCollection"

    def __init__(
        self,
        module: EmbeddingCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        fused_params: Dict[str, Any] | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._init_collection(module.embedding_configs(), table_plans, env, device, fused_params,
                              pooled=False, is_weighted=False, what="EmbeddingCollection")
        self._need_indices = module.need_indices()
        self._adopt_shardings(build_sequence_shardings(
            self._table_specs(), env, self._device, qcomm_codecs_registry))
        self._pieces = self._feature_pieces()
        self._init_from(module)

    def _feature_pieces(self) -> Dict[str, _Pieces]:
        """Per module feature, where its column pieces come from, in column order."""
        found: Dict[str, List[Tuple[int, str, int]]] = {f: [] for f in self._feature_names}
        for name, sharding in self._shardings.items():
            for k, (feature, col_offset, _) in enumerate(sharding.output_columns):
                found[feature].append((col_offset, name, k))
        return {f: [(name, k) for _, name, k in sorted(p)] for f, p in found.items()}

    # ---------------------------------------------------------------- sharded module steps

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        pending = {
            name: s.output_dist(local, sharding_ctx)
            for (name, s), sharding_ctx, local
            in zip(self._shardings.items(), ctx.sharding_contexts, output)
        }
        return _JaggedDictAwaitable(pending, ctx.features, self)

    def embedding_configs(self):  # noqa: ANN201 - mirrors the unsharded module
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices


class EmbeddingCollectionSharder(ModuleSharder[EmbeddingCollection]):
    """Data-parallel, table-wise, column-wise and row-wise, on CPU and CUDA."""

    @property
    def module_type(self) -> type:
        return EmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return sorted(sharding_type_values(SEQUENCE_SHARDING_TYPES))

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return supported_compute_kernels(sharding_type, compute_device_type)

    def shardable_parameters(self, module: EmbeddingCollection) -> Dict[str, nn.Parameter]:
        return {name: emb.weight for name, emb in module.embeddings.items()}

    def shard(
        self,
        module: EmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedEmbeddingCollection:
        return ShardedEmbeddingCollection(
            module, params, env, device, self.fused_params, self.qcomm_codecs_registry
        )
