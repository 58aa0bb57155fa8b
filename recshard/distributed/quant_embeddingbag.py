"""ShardedQuantEmbeddingBagCollection: quantized tables spread over ranks, for inference.

    plan = construct_module_sharding_plan(qebc, {"t0": table_wise(1, compute_kernel="quant"),
                                                 "t1": row_wise(compute_kernel="quant")}, world_size=2)
    model = DistributedModelParallel(quantized_model, plan=ShardingPlan({"ebc": plan}),
                                     sharders=[QuantEmbeddingBagCollectionSharder()])

Everything but the lookup is the float sharded EBC's: the input side (checks, bounds-check
modes, wire permute, rank-synced rejection) from `ShardedTablesMixin`, routing and output
dists (KJT all-to-all, pooled all-to-all, reduce-scatter) from the shardings that
`build_pooled_shardings` makes for the plan, the output `KeyedTensor` in the unsharded key
order. Only each sharding's local lookup is quantized (`recshard.distributed.quant_shards`).
No backward, no optimizer.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from recshard.distributed.module_state import EmbeddingModuleContext, ShardedTablesMixin
from recshard.distributed.pooled_output import PooledOutputMixin
from recshard.distributed.quant_shards import (
    META,
    QUANT_KERNELS,
    QuantSharder,
    check_packed_columns,
    load_quant_shards,
    placeholder_specs,
    swap_in_quant_lookups,
)
from recshard.plan.sharding_types import ALL_SHARDING_TYPES, sharding_type_values
from recshard.quant.embedding_modules import QuantEmbeddingBagCollection
from recshard.sharding.build import build_pooled_shardings
from recshard.sparse import KeyedJaggedTensor
from recshard.types import (
    EmbeddingModuleShardingPlan,
    ShardedModule,
    ShardingEnv,
)


class ShardedQuantEmbeddingBagCollection(PooledOutputMixin, ShardedTablesMixin, ShardedModule):
    """Sharded twin of `QuantEmbeddingBagCollection`, built by its sharder. Inference only."""

    _owner = "ShardedQuantEmbeddingBagCollection"
    # the float sharded EBC's output side: columns back in module key order, as a KeyedTensor

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        configs = module.embedding_bag_configs()
        self._init_collection(configs, table_plans, env, device, fused_params, pooled=True,
                              is_weighted=module.is_weighted(), what="QuantEmbeddingBagCollection", compute_kernels=QUANT_KERNELS)
        check_packed_columns(configs, table_plans)
        self._output_dtype = module.output_dtype()
        specs = placeholder_specs(configs, table_plans, self._output_dtype)
        shardings = build_pooled_shardings(specs, env, META, self._is_weighted, qcomm_codecs_registry)
        swap_in_quant_lookups(shardings, configs, True, self._device, self._output_dtype)
        self._adopt_shardings(shardings)
        self._column_blocks = self._output_order()
        load_quant_shards(shardings, module.quantized_weights(), self._device)

    def compute(self, ctx: EmbeddingModuleContext, dist_input: List[KeyedJaggedTensor]) -> List[torch.Tensor]:
        return [s.lookup(kjt) for s, kjt in zip(self._shardings.values(), dist_input)]

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
