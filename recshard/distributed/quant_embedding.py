"""ShardedQuantEmbeddingCollection: quantized sequence tables spread over ranks, for inference,
and its sharder.

    plan = construct_module_sharding_plan(qec, {"t0": table_wise(1, compute_kernel="quant"),
                                                "t1": row_wise(compute_kernel="quant")}, world_size=2)
    model = DistributedModelParallel(quantized_model, plan=ShardingPlan({"ec": plan}),
                                     sharders=[QuantEmbeddingCollectionSharder()])

Everything but the lookup is the float `ShardedEmbeddingCollection`'s: the input side
(`input_dist.py`), the sequence shardings (one per kind and row width), the sequence
all-to-alls back and the `{feature: JaggedTensor}` output (`sequence_output_dist`). Each
sharding's lookup is quantized (`recshard.distributed.quant_shards`). No backward, no optimizer.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from recshard.distributed.embedding import SequenceOutputLayout, sequence_output_dist
from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.distributed.module_state import ShardedEmbeddingModule
from recshard.distributed.quant_shards import (
    META,
    QUANT_KERNELS,
    QuantSharder,
    check_packed_columns,
    load_quant_shards,
    placeholder_specs,
    swap_in_quant_lookups,
)
from recshard.modules.embedding_configs import EmbeddingConfig
from recshard.plan.sharding_types import SEQUENCE_SHARDING_TYPES, sharding_type_values
from recshard.quant.embedding_modules import QuantEmbeddingCollection
from recshard.sharding.sequence import build_sequence_shardings
from recshard.sparse import JaggedTensor, KeyedJaggedTensor
from recshard.types import (
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ShardingEnv,
)


class ShardedQuantEmbeddingCollection(ShardedEmbeddingModule):
    """Sharded twin of `QuantEmbeddingCollection` (DP, TW, CW, RW), built by its sharder."""

    def __init__(
        self,
        module: QuantEmbeddingCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        configs = module.embedding_configs()
        super().__init__("ShardedQuantEmbeddingCollection", "QuantEmbeddingCollection",
                         "embeddings", configs, table_plans, env, device, fused_params,
                         pooled=False, is_weighted=False, compute_kernels=QUANT_KERNELS)
        check_packed_columns(configs, table_plans)
        self._output_dtype = module.output_dtype()
        specs = placeholder_specs(configs, table_plans, self._output_dtype)
        shardings = build_sequence_shardings(specs, env, META, qcomm_codecs_registry)
        swap_in_quant_lookups(shardings, configs, False, self._device, self._output_dtype)
        self.set_shardings(shardings)
        self._layout = SequenceOutputLayout(self.shardings, self._embedding_names,
                                            module.need_indices())
        load_quant_shards(shardings, module.quantized_weights(), self._device)

    def compute(
        self, ctx: EmbeddingModuleContext, dist_input: List[KeyedJaggedTensor]
    ) -> List[torch.Tensor]:
        """Each sharding's quantized lookup (dequantized rows, one per id) on the ids here."""
        return [s.compute(kjt) for s, kjt in zip(self.shardings.values(), dist_input)]

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        """Rows back to the ranks that own the batch, cut per feature, column shards joined."""
        return sequence_output_dist(self.shardings, self._layout, ctx, output)

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._layout.need_indices

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype


class QuantEmbeddingCollectionSharder(QuantSharder):
    """Shards `QuantEmbeddingCollection`s for inference (data-parallel, table-wise,
    column-wise, row-wise; plans use compute_kernel="quant")."""

    sharded_type = ShardedQuantEmbeddingCollection

    @property
    def module_type(self) -> type:
        return QuantEmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return sorted(sharding_type_values(SEQUENCE_SHARDING_TYPES))

    def shardable_parameters(self, module: QuantEmbeddingCollection) -> Dict[str, nn.Module]:
        return {name: tables.weight for name, tables in module.embeddings.items()}
