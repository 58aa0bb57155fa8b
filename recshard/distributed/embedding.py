"""ShardedEmbeddingCollection: an EmbeddingCollection whose tables live on many ranks, and
its sharder.

forward = input_dist (as the sharded EBC's, `input_dist.py`: check the batch, permute it
once into wire order, route ids with two-stage all-to-alls) -> compute (sequence lookups, one row
per id) -> output_dist (sequence all-to-alls back), each step asynchronous. The result is
`{feature: JaggedTensor}` like the unsharded module's: values `[N_f, D]` in the input's id
order, the input's lengths, keys in the module's feature order, ids as weights when
`need_indices`. Column shards of a feature are joined along dim 1 in column order.

Tables may have different dims (TorchRec requires one): see `recshard/sharding/sequence.py`.
Gradient convention as the sharded EBC: updates use the mean over ranks of the gradients.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from recshard.distributed.index_dedup import Deduplicated, deduplicate, restore
from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.distributed.module_state import EmbeddingModuleSharder, ShardedEmbeddingModule
from recshard.modules.embedding_configs import EmbeddingConfig
from recshard.modules.embedding_modules import EmbeddingCollection
from recshard.plan.sharding_types import SEQUENCE_SHARDING_TYPES, sharding_type_values
from recshard.sharding.common import EmbeddingSharding
from recshard.sharding.sequence import build_sequence_shardings
from recshard.sparse import JaggedTensor, KeyedJaggedTensor
from recshard.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ShardingEnv,
)

# (sharding name, position among its output columns) of every piece of a feature, by column
_Pieces = List[Tuple[str, int]]


EC_INDEX_DEDUP = False  # TorchRec's process-wide default for `use_index_dedup`


def set_ec_index_dedup(val: bool) -> None:
    """Deduplicate the ids of sharded EmbeddingCollections built from now on (TorchRec's
    deprecated global switch: pass `use_index_dedup` to the sharder instead)."""
    warnings.warn(
        "Please set use_index_dedup in EmbeddingCollectionSharder during __init__ instead",
        DeprecationWarning,
        stacklevel=2,
    )
    global EC_INDEX_DEDUP
    EC_INDEX_DEDUP = bool(val)


def get_ec_index_dedup() -> bool:
    return EC_INDEX_DEDUP


@dataclass
class EmbeddingCollectionContext(EmbeddingModuleContext):
    """The sharded EC's per-batch context (TorchRec's name); with index dedup, the caller's
    batch and the inverse indices that spread the looked-up rows back over it."""

    deduplicated: Deduplicated | None = None

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        super().record_stream(stream)
        if self.deduplicated is not None:
            self.deduplicated.features.record_stream(stream)
            for inverse in self.deduplicated.inverse.values():
                inverse.record_stream(stream)


class SequenceOutputLayout:
    """Per output key (embedding name), where its column pieces come from (in column order),
    and each sharding's input keys (to cut its rows per key)."""

    def __init__(
        self,
        shardings: Dict[str, EmbeddingSharding],
        embedding_names: List[str],
        need_indices: bool,
    ) -> None:
        found: Dict[str, List[Tuple[int, str, int]]] = {f: [] for f in embedding_names}
        for name, sharding in shardings.items():
            for k, (feature, col_offset, _) in enumerate(sharding.output_columns):
                found[feature].append((col_offset, name, k))
        self.pieces: Dict[str, _Pieces] = {
            f: [(name, k) for _, name, k in sorted(p)] for f, p in found.items()
        }
        self.input_features = {name: s.input_features for name, s in shardings.items()}
        self.need_indices = need_indices


class _JaggedDictAwaitable(LazyAwaitable[Dict[str, JaggedTensor]]):
    """Waits every sharding's sequence all-to-all, cuts the rows per feature and joins the
    column shards of each feature."""

    def __init__(
        self,
        pending: Dict[str, Awaitable[torch.Tensor]],
        features: KeyedJaggedTensor,
        layout: SequenceOutputLayout,
    ) -> None:
        super().__init__()
        self._pending, self._features, self._layout = pending, features, layout

    def _wait_impl(self) -> Dict[str, JaggedTensor]:
        layout, inputs = self._layout, self._features.to_dict()
        ids_per_feature = dict(zip(self._features.keys(), self._features.length_per_key()))
        chunks: Dict[str, List[torch.Tensor]] = {}
        for name, pending in self._pending.items():
            sizes = [ids_per_feature[f] for f in layout.input_features[name]]
            chunks[name] = list(pending.wait().split(sizes))
        out: Dict[str, JaggedTensor] = {}
        for feature, pieces in layout.pieces.items():
            parts = [chunks[name][k] for name, k in pieces]
            jt = inputs[feature]
            out[feature] = JaggedTensor(
                parts[0] if len(parts) == 1 else torch.cat(parts, dim=1),
                weights=jt.values() if layout.need_indices else None,
                lengths=jt.lengths(),
                offsets=jt.offsets(),
            )
        return out


def sequence_output_dist(
    shardings: Dict[str, EmbeddingSharding],
    layout: SequenceOutputLayout,
    ctx: EmbeddingModuleContext,
    output: List[torch.Tensor],
) -> LazyAwaitable[Dict[str, JaggedTensor]]:
    """Start every sharding's sequence all-to-all; the wait gives `{feature: JaggedTensor}`."""
    pending = {
        name: s.output_dist(local, sharding_ctx)
        for (name, s), sharding_ctx, local in zip(shardings.items(), ctx.sharding_contexts, output)
    }
    return _JaggedDictAwaitable(pending, ctx.features, layout)


class ShardedEmbeddingCollection(ShardedEmbeddingModule):
    """Sharded twin of `EmbeddingCollection` (DP, TW, CW, RW), built by
    `EmbeddingCollectionSharder`. `use_index_dedup` (or `set_ec_index_dedup(True)` before it
    is built): each feature's distinct ids only cross the all-to-alls (`index_dedup.py`)."""

    def __init__(
        self,
        module: EmbeddingCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        fused_params: Dict[str, Any] | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
        use_index_dedup: bool = False,
    ) -> None:
        super().__init__(
            module,
            "embeddings",
            module.embedding_configs(),
            table_plans,
            env,
            device,
            fused_params,
            pooled=False,
            is_weighted=False,
        )
        self.set_shardings(
            build_sequence_shardings(
                self.storage.table_specs(self, module),
                env,
                self._device,
                qcomm_codecs_registry,
                self.storage.make_lookup,
            )
        )
        self._layout = SequenceOutputLayout(
            self.shardings, self._embedding_names, module.need_indices()
        )
        self._use_index_dedup = use_index_dedup or get_ec_index_dedup()
        features = [f for c in self._configs for f in c.feature_names]
        self._feature_of = dict(zip(self._embedding_names, features))
        self.storage.load(self, module)

    def create_context(self) -> EmbeddingCollectionContext:
        return EmbeddingCollectionContext(
            sharding_contexts=super().create_context().sharding_contexts
        )

    def input_dist(
        self, ctx: EmbeddingModuleContext, features: KeyedJaggedTensor, rejected: str | None = None
    ) -> Awaitable[Awaitable[List[KeyedJaggedTensor]]]:
        """`ShardedEmbeddingModule`'s, on each feature's distinct ids with index dedup."""
        if self._use_index_dedup and isinstance(ctx, EmbeddingCollectionContext):
            found = deduplicate(features)
            if found is not None:
                features, ctx.deduplicated = found
        return super().input_dist(ctx, features, rejected)

    # compute: `ShardedEmbeddingModule`'s

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        """Rows back to the ranks that own the batch, cut per feature, column shards joined
        (and spread back over repeated ids with index dedup)."""
        result = sequence_output_dist(self.shardings, self._layout, ctx, output)
        dedup = ctx.deduplicated if isinstance(ctx, EmbeddingCollectionContext) else None
        if dedup is not None:
            result.callbacks.append(
                partial(
                    restore,
                    dedup=dedup,
                    feature_of=self._feature_of,
                    need_indices=self._layout.need_indices,
                )
            )
        return result

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._layout.need_indices


class EmbeddingCollectionSharder(EmbeddingModuleSharder):
    """Data-parallel, table-wise, column-wise and row-wise, on CPU and CUDA.
    `use_index_dedup`: the sharded collections send each feature's distinct ids only."""

    sharded_type = ShardedEmbeddingCollection

    def __init__(
        self,
        fused_params: Dict[str, Any] | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
        use_index_dedup: bool = False,
    ) -> None:
        super().__init__(fused_params, qcomm_codecs_registry)
        self._use_index_dedup = use_index_dedup

    def shard(
        self,
        module: nn.Module,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedEmbeddingCollection:
        return self.sharded_type(
            module,
            params,
            env,
            device,
            self.fused_params,
            self.qcomm_codecs_registry,
            self._use_index_dedup,
        )

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return sorted(sharding_type_values(SEQUENCE_SHARDING_TYPES))

    @property
    def module_type(self) -> type:
        return EmbeddingCollection

    def shardable_parameters(self, module: EmbeddingCollection) -> Dict[str, nn.Parameter]:
        return {name: emb.weight for name, emb in module.embeddings.items()}
