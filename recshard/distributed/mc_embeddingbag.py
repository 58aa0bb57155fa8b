"""ShardedManagedCollisionEmbeddingBagCollection and its sharder (TorchRec's
`torchrec.distributed.mc_embeddingbag`): `recshard.distributed.mc_embedding_modules` over a
sharded EmbeddingBagCollection."""

from __future__ import annotations

from typing import Any, Dict

from recshard.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recshard.distributed.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollectionSharder,
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recshard.distributed.mc_modules import ManagedCollisionCollectionSharder
from recshard.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection


class ShardedManagedCollisionEmbeddingBagCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """Forward returns `(KeyedTensor, None)`, as the unsharded module."""

    @property
    def _embedding_bag_collection(self) -> ShardedEmbeddingBagCollection:
        return self._embedding_module  # type: ignore[return-value]


class ManagedCollisionEmbeddingBagCollectionSharder(BaseManagedCollisionEmbeddingCollectionSharder):
    sharded_type = ShardedManagedCollisionEmbeddingBagCollection

    def __init__(
        self,
        ebc_sharder: EmbeddingBagCollectionSharder | None = None,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        fused_params: Dict[str, Any] | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            ebc_sharder or EmbeddingBagCollectionSharder(fused_params, qcomm_codecs_registry),
            mc_sharder,
            qcomm_codecs_registry,
        )

    @property
    def module_type(self) -> type:
        return ManagedCollisionEmbeddingBagCollection
