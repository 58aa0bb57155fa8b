"""ShardedQuantEmbeddingBagCollection: quantized tables spread over ranks, for inference.

    plan = construct_module_sharding_plan(qebc, {"t0": table_wise(1, "quant"),
                                                 "t1": row_wise("quant")}, world_size=2)
    model = DistributedModelParallel(quantized_model, plan=ShardingPlan({"ebc": plan}),
                                     sharders=[QuantEmbeddingBagCollectionSharder()])

Everything but the lookup is the float sharded EBC's: the input side (checks, bounds-check
modes, wire permute, rank-synced rejection) from `ShardedTablesMixin`, routing and output
dists (KJT all-to-all, pooled all-to-all, reduce-scatter) from the shardings that
`build_pooled_shardings` makes for the plan, the output `KeyedTensor` in the unsharded key
order. Only each sharding's local lookup is swapped for a quantized one (`QuantLookup`),
loaded with this rank's slice of the already quantized rows: row shards take their rows,
column shards their packed columns with the full row's scale/bias, so every shard
dequantizes to exactly what the unsharded quantized module reads. No backward, no optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from recshard.distributed.module_state import ShardedTablesMixin
from recshard.distributed.pooled_output import PooledOutputMixin
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import DataType
from recshard.quant.embedding_modules import QuantEmbeddingBagCollection
from recshard.quant.kernel import QuantLookup, QuantTable
from recshard.quant.rowwise import BITS
from recshard.sharding.build import build_pooled_shardings
from recshard.sharding.common import TableSpec
from recshard.sparse import KeyedJaggedTensor
from recshard.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)

QUANT_SHARDING_TYPES = [t.value for t in ShardingType]
_META = torch.device("meta")


class QuantShardLookup(nn.Module):
    """A sharding's local lookup over quantized shards (GroupedLookup's contract).

    Input: KJT with keys `[f for t in self.tables for f in t.feature_names]`.
    Output: pooled `[B, sum of those features' local dims]`.
    """

    def __init__(self, tables: List[LocalTable], device: torch.device, output_dtype: torch.dtype) -> None:
        super().__init__()
        self.tables = tables
        self._device, self._output_dtype = device, output_dtype
        quant_tables = [QuantTable(t.name, t.rows, t.cols, t.config.data_type, t.feature_names,
                                   t.pooling) for t in tables]
        self.kernels = nn.ModuleList(
            [QuantLookup(quant_tables, True, device, output_dtype)] if tables else []
        )

    def table_weights(self) -> List[torch.Tensor]:
        """Each local shard's stored values (packed codes or fp16/fp32 rows), views."""
        return [values for k in self.kernels for values, _ in k.storage()]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if not self.kernels:
            return torch.empty(features.stride(), 0, dtype=self._output_dtype, device=self._device)
        return self.kernels[0](features)


def _check_plan(module: QuantEmbeddingBagCollection, plan: EmbeddingModuleShardingPlan) -> None:
    for config in module.embedding_bag_configs():
        entry = plan[config.name]
        if entry.compute_kernel != EmbeddingComputeKernel.QUANT.value:
            raise ValueError(
                f"table '{config.name}': a QuantEmbeddingBagCollection is sharded with "
                f"compute_kernel='quant', got '{entry.compute_kernel}'"
            )
        bits = BITS.get(config.data_type)
        for shard in entry.shards or []:
            col, width = shard.shard_offsets[1], shard.shard_sizes[1]
            if bits and (col * bits % 8 or width * bits % 8):
                raise ValueError(
                    f"table '{config.name}': a column shard at column {col} of width {width} "
                    f"splits a byte of packed {config.data_type.value} values; shard at "
                    f"multiples of {8 // bits} columns"
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
                              is_weighted=module.is_weighted(), what="QuantEmbeddingBagCollection")
        _check_plan(module, table_plans)
        self._output_dtype = module.output_dtype()
        # Routing and output dists come from the float shardings, built around placeholder
        # dense lookups on `meta` (no memory); their lookups are then swapped for quantized ones.
        specs = [
            TableSpec(dataclasses.replace(c, data_type=DataType.FP32),
                      dataclasses.replace(table_plans[c.name],
                                          compute_kernel=EmbeddingComputeKernel.DENSE.value))
            for c in configs
        ]
        shardings = build_pooled_shardings(specs, env, _META, self._is_weighted, qcomm_codecs_registry)
        by_name = {c.name: c for c in configs}
        for sharding in shardings.values():
            tables = [dataclasses.replace(t, config=by_name[t.name],
                                          compute_kernel=EmbeddingComputeKernel.QUANT)
                      for t in sharding.lookup.tables]
            sharding.lookup = QuantShardLookup(tables, self._device, self._output_dtype)
        self._adopt_shardings(shardings)
        self._block_permute = self._output_permute()
        self._load_shards(module)

    def _load_shards(self, module: QuantEmbeddingBagCollection) -> None:
        """Copy this rank's rows (and packed columns) out of the unsharded quantized tables."""
        full = module.quantized_weights()
        for sharding in self._shardings.values():
            for kernel in sharding.lookup.kernels:  # one kernel holding every local shard
                for index, local in enumerate(sharding.lookup.tables):
                    values, scale_bias = full[local.name]
                    rows = slice(local.row_offset, local.row_offset + local.rows)
                    per_byte = 8 // BITS.get(local.config.data_type, 8)  # packed columns
                    cols = slice(local.col_offset // per_byte, (local.col_offset + local.cols) // per_byte)
                    kernel.load_quantized(
                        index, values[rows, cols].to(self._device),
                        None if scale_bias is None else scale_bias[rows].to(self._device),
                    )

    def compute(self, ctx: Dict[str, Any], dist_input: List[KeyedJaggedTensor]) -> List[torch.Tensor]:
        return [s.lookup(kjt) for s, kjt in zip(self._shardings.values(), dist_input)]


    def output_dtype(self) -> torch.dtype:
        return self._output_dtype


class QuantEmbeddingBagCollectionSharder(ModuleSharder[QuantEmbeddingBagCollection]):
    """Shards `QuantEmbeddingBagCollection`s for inference (every pooled sharding type; plans
    use compute_kernel="quant"). `qcomm_codecs_registry` applies to the output dists too."""

    @property
    def module_type(self) -> type:
        return QuantEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(QUANT_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.QUANT.value]

    def shardable_parameters(self, module: QuantEmbeddingBagCollection) -> Dict[str, torch.Tensor]:
        return {name: tables.weight for name, tables in module.embedding_bags.items()}

    def shard(
        self,
        module: QuantEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedQuantEmbeddingBagCollection:
        return ShardedQuantEmbeddingBagCollection(
            module, params, env, device, self.fused_params, self.qcomm_codecs_registry
        )
