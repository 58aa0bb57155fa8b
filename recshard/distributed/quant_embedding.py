"""ShardedQuantEmbeddingCollection: quantized sequence tables spread over ranks, for inference,
and its sharder.

    plan = construct_module_sharding_plan(
        qec,
        {"t0": table_wise(1, compute_kernel="quant"), "t1": row_wise(compute_kernel="quant")},
        world_size=2,
    )
    model = DistributedModelParallel(quantized_model, plan=ShardingPlan({"ec": plan}),
                                     sharders=[QuantEmbeddingCollectionSharder()])

It is the float `ShardedEmbeddingCollection` with quantized table storage (`QuantTables`,
`quant_shards.py`): the same input side (`input_dist.py`), the same sequence shardings (one
per kind and row width; rows come back in the module's `output_dtype`), the sequence
all-to-alls back and the `{feature: JaggedTensor}` output; each sharding is built with a
quantized lookup over this rank's slice of the rows. No backward, no optimizer.
"""

from __future__ import annotations

import torch

from recshard.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from recshard.distributed.quant_shards import QuantTables
from recshard.quant.embedding_modules import QuantEmbeddingCollection


class ShardedQuantEmbeddingCollection(ShardedEmbeddingCollection):
    """Sharded twin of `QuantEmbeddingCollection` (DP, TW, CW, RW), built by its sharder."""

    storage_type = QuantTables

    def output_dtype(self) -> torch.dtype:
        return self.storage.output_dtype


class QuantEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """Shards `QuantEmbeddingCollection`s for inference (data-parallel, table-wise,
    column-wise, row-wise; plans use compute_kernel="quant"). Shardable parameters: the
    tables' quantized `weight` buffers."""

    sharded_type = ShardedQuantEmbeddingCollection

    @property
    def module_type(self) -> type:
        return QuantEmbeddingCollection
