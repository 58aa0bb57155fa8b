"""ShardedQuantEmbeddingBagCollection: quantized tables spread over ranks, for inference, and
its sharder.

    plan = construct_module_sharding_plan(
        qebc,
        {"t0": table_wise(1, compute_kernel="quant"), "t1": row_wise(compute_kernel="quant")},
        world_size=2,
    )
    model = DistributedModelParallel(quantized_model, plan=ShardingPlan({"ebc": plan}),
                                     sharders=[QuantEmbeddingBagCollectionSharder()])

It is the float `ShardedEmbeddingBagCollection` with quantized table storage (`QuantTables`,
`quant_shards.py`): the same input side (checks, bounds-check modes, wire permute, rank-synced
rejection, `input_dist.py`), the same shardings and output dists (KJT all-to-all, pooled
all-to-all, reduce-scatter), the output `KeyedTensor` in the unsharded key order
(`pooled_output.py`); each sharding is built with a quantized lookup over this rank's slice of
the rows. No backward, no optimizer.
"""

from __future__ import annotations

import torch

from recshard.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recshard.distributed.quant_shards import QuantTables
from recshard.quant.embedding_modules import QuantEmbeddingBagCollection


class ShardedQuantEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """Sharded twin of `QuantEmbeddingBagCollection`, built by its sharder. Inference only."""

    storage_type = QuantTables
    takes_variable_batch = False  # the quantized lookups pool one batch per rank

    def output_dtype(self) -> torch.dtype:
        return self.storage.output_dtype


class QuantEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards `QuantEmbeddingBagCollection`s for inference (every pooled sharding type; plans
    use compute_kernel="quant"). `qcomm_codecs_registry` applies to the output dists too.
    Shardable parameters: the tables' quantized `weight` buffers."""

    sharded_type = ShardedQuantEmbeddingBagCollection

    @property
    def module_type(self) -> type:
        return QuantEmbeddingBagCollection
