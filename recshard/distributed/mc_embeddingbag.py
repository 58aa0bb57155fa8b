"""ShardedManagedCollisionEmbeddingBagCollection and its sharder (TorchRec's
`torchrec.distributed.mc_embeddingbag`): `recshard.distributed.mc_embedding_modules` over a
sharded EmbeddingBagCollection."""

from __future__ import annotations

from typing import Any, Dict

import torch

from recshard.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recshard.distributed.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollectionSharder,
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recshard.distributed.mc_modules import ManagedCollisionCollectionSharder
from recshard.modules.embedding_configs import PoolingType
from recshard.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recshard.sparse import KeyedJaggedTensor


class ShardedManagedCollisionEmbeddingBagCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """Forward returns `(KeyedTensor, None)`, as the unsharded module. Row-wise pooling: each
    owner pools its part of every bag, a reduce-scatter sums the parts (MEAN tables divide
    by the bag lengths kept here)."""

    def _before_send(
        self, sharding_ctx: Any, features: KeyedJaggedTensor, sent_to: torch.Tensor
    ) -> None:
        mean = [
            f
            for c in self._configs.values()
            if getattr(c, "pooling", None) == PoolingType.MEAN
            for f in c.feature_names
        ]
        if mean:
            sharding_ctx.mean_lengths = {f: features[f].lengths() for f in mean}

    def _after_splits(self, sharding_ctx: Any, tensors: Any) -> None:
        sizes = getattr(tensors, "stride_per_rank", None)
        if sizes is not None and len(set(sizes)) > 1:  # unequal batches reduce-scatter so
            sharding_ctx.batch_size_per_rank = list(sizes)

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
