"""ShardedQuantEmbeddingBagCollection: quantized tables spread over ranks, for inference, and
its sharder.

    plan = construct_module_sharding_plan(qebc, {"t0": table_wise(1, compute_kernel="quant"),
                                                 "t1": row_wise(compute_kernel="quant")}, world_size=2)
    model = DistributedModelParallel(quantized_model, plan=ShardingPlan({"ebc": plan}),
                                     sharders=[QuantEmbeddingBagCollectionSharder()])

Everything but the lookup is the float sharded EBC's: the input side (checks, bounds-check
modes, wire permute, rank-synced rejection, `input_dist.py`), routing and output dists (KJT
all-to-all, pooled all-to-all, reduce-scatter) from the shardings that
`build_pooled_shardings` makes for the plan, the output `KeyedTensor` in the unsharded key
order (`pooled_output.py`). Only each sharding's local lookup is quantized
(`recshard.distributed.quant_shards`). No backward, no optimizer.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.distributed.module_state import ShardedEmbeddingModule
from recshard.distributed.pooled_output import PooledOutputLayout, pooled_output_dist
from recshard.distributed.quant_shards import (
    META,
    QUANT_KERNELS,
    QuantSharder,
    check_packed_columns,
    load_quant_shards,
    placeholder_specs,
    swap_in_quant_lookups,
)
from recshard.modules.embedding_configs import EmbeddingBagConfig
from recshard.plan.sharding_types import ALL_SHARDING_TYPES, sharding_type_values
from recshard.quant.embedding_modules import QuantEmbeddingBagCollection
from recshard.sharding.build import build_pooled_shardings
from recshard.sparse import KeyedJaggedTensor, KeyedTensor
from recshard.types import (
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ShardingEnv,
)


class ShardedQuantEmbeddingBagCollection(ShardedEmbeddingModule):
    """Sharded twin of `QuantEmbeddingBagCollection`, built by its sharder. Inference only."""

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        configs = module.embedding_bag_configs()
        super().__init__("ShardedQuantEmbeddingBagCollection", "QuantEmbeddingBagCollection",
                         "embedding_bags", configs, table_plans, env, device, fused_params,
                         pooled=True, is_weighted=module.is_weighted(), compute_kernels=QUANT_KERNELS)
        check_packed_columns(configs, table_plans)
        self._output_dtype = module.output_dtype()
        specs = placeholder_specs(configs, table_plans, self._output_dtype)
        shardings = build_pooled_shardings(specs, env, META, self._is_weighted, qcomm_codecs_registry)
        swap_in_quant_lookups(shardings, configs, True, self._device, self._output_dtype)
        self.set_shardings(shardings)
        self._layout = PooledOutputLayout(
            list(self.shardings.values()), self._embedding_names, self._embedding_dims)
        load_quant_shards(shardings, module.quantized_weights(), self._device)

    def compute(
        self, ctx: EmbeddingModuleContext, dist_input: List[KeyedJaggedTensor]
    ) -> List[torch.Tensor]:
        """Each sharding's quantized lookup (dequantized, pooled) on the ids routed here."""
        return [s.lookup(kjt) for s, kjt in zip(self.shardings.values(), dist_input)]

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        """Pooled rows back to the ranks that own the batch, in the module's key order."""
        return pooled_output_dist(list(self.shardings.values()), self._layout, ctx, output)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype


class QuantEmbeddingBagCollectionSharder(QuantSharder):
    """Shards `QuantEmbeddingBagCollection`s for inference (every pooled sharding type; plans
    use compute_kernel="quant"). `qcomm_codecs_registry` applies to the output dists too."""

    sharded_type = ShardedQuantEmbeddingBagCollection

    @property
    def module_type(self) -> type:
        return QuantEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return sharding_type_values(ALL_SHARDING_TYPES)

    def shardable_parameters(self, module: QuantEmbeddingBagCollection) -> Dict[str, torch.Tensor]:
        return {name: tables.weight for name, tables in module.embedding_bags.items()}
