"""ShardedManagedCollisionEmbeddingCollection and its sharder (TorchRec's
`torchrec.distributed.mc_embedding`): `recshard.distributed.mc_embedding_modules` over a
sharded EmbeddingCollection. Row-wise: each owner looks up the ids routed to it, the sequence
all-to-all sends the rows back and the routing's permutation restores the input's id order."""

from __future__ import annotations

from typing import Any, Dict

import torch

from recshard.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from recshard.distributed.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollectionSharder,
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recshard.distributed.mc_modules import ManagedCollisionCollectionSharder
from recshard.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from recshard.sparse import KeyedJaggedTensor
from recshard.types import EmbeddingModuleShardingPlan, ShardingEnv


class ShardedManagedCollisionEmbeddingCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """Forward returns `({feature: JaggedTensor}, None)`, as the unsharded module."""

    def __init__(
        self,
        module: ManagedCollisionEmbeddingCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None,
        e_sharder: EmbeddingCollectionSharder,
        mc_sharder: ManagedCollisionCollectionSharder,
    ) -> None:
        if module._embedding_collection.need_indices():
            raise ValueError(
                "ManagedCollisionEmbeddingCollection: an EmbeddingCollection with "
                "need_indices=True is not supported sharded (its indices would be raw ids "
                "here, rows unsharded)"
            )
        super().__init__(module, table_plans, env, device, e_sharder, mc_sharder)

    @property
    def _embedding_collection(self) -> ShardedEmbeddingCollection:
        return self._embedding_module  # type: ignore[return-value]

    def _before_send(
        self, sharding_ctx: Any, features: KeyedJaggedTensor, sent_to: torch.Tensor
    ) -> None:
        sharding_ctx.unbucketize_permute = sent_to

    def _after_splits(self, sharding_ctx: Any, tensors: Any) -> None:
        sharding_ctx.a2a = tensors

    def _on_arrival(self, sharding_ctx: Any, received: KeyedJaggedTensor) -> None:
        sharding_ctx.received_lengths = received.lengths()


class ManagedCollisionEmbeddingCollectionSharder(BaseManagedCollisionEmbeddingCollectionSharder):
    sharded_type = ShardedManagedCollisionEmbeddingCollection

    def __init__(
        self,
        ec_sharder: EmbeddingCollectionSharder | None = None,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        fused_params: Dict[str, Any] | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            ec_sharder or EmbeddingCollectionSharder(fused_params, qcomm_codecs_registry),
            mc_sharder,
            qcomm_codecs_registry,
        )

    @property
    def module_type(self) -> type:
        return ManagedCollisionEmbeddingCollection
