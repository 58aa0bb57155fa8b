"""What the sharded quantized collections share: plan checks, placeholder float shardings
whose lookups are swapped for quantized ones, and loading each rank's slice of the rows.

The routing and output dists of a sharded quantized collection are the float module's, built
around placeholder dense lookups on `meta` (no memory). Each sharding's lookup is then swapped
for a `QuantShardLookup` loaded with this rank's slice of the already quantized rows: row
shards take their rows, column shards their packed columns with the full row's scale/bias,
so every shard dequantizes to exactly what the unsharded quantized module reads.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch
from torch import nn

from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import BaseEmbeddingConfig, DataType
from recshard.quant.embedding_modules import QuantizedWeights
from recshard.quant.kernel import QuantLookup, QuantTable
from recshard.quant.rowwise import BITS
from recshard.sharding.common import EmbeddingSharding, TableSpec
from recshard.sparse import KeyedJaggedTensor
from recshard.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardedModule,
    ShardingEnv,
)

META = torch.device("meta")
_PLACEHOLDER_TYPES = {torch.float32: DataType.FP32, torch.float16: DataType.FP16,
                      torch.bfloat16: DataType.BF16}

class QuantShardLookup(nn.Module):
    """A sharding's local lookup over quantized shards (GroupedLookup's contract).

    Input: KJT with keys `[f for t in self.tables for f in t.feature_names]`.
    Output: pooled `[B, sum of those features' local dims]`, or sequence `[N, D]`.
    """

    def __init__(self, tables: List[LocalTable], pooled: bool, device: torch.device,
                 output_dtype: torch.dtype) -> None:
        super().__init__()
        self.tables = tables
        self._pooled, self._device, self._output_dtype = pooled, device, output_dtype
        quant_tables = [QuantTable(t.name, t.rows, t.cols, t.config.data_type, t.feature_names,
                                   t.pooling) for t in tables]
        self.kernels = nn.ModuleList(
            [QuantLookup(quant_tables, pooled, device, output_dtype)] if tables else []
        )

    def table_weights(self) -> List[torch.Tensor]:
        """Each local shard's stored values (packed codes or fp16/fp32 rows), views."""
        return [values for k in self.kernels for values, _ in k.storage()]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if not self.kernels:
            shape = (features.stride(), 0) if self._pooled else (features.values().numel(), 0)
            return torch.empty(*shape, dtype=self._output_dtype, device=self._device)
        return self.kernels[0](features)


QUANT_KERNELS = [EmbeddingComputeKernel.QUANT.value]


def check_packed_columns(configs: List[BaseEmbeddingConfig],
                         plan: EmbeddingModuleShardingPlan) -> None:
    """Column shards never split a byte of packed values (the rest of the plan is checked by
    `recshard.plan.validate` when the module is built, with `QUANT_KERNELS`)."""
    for config in configs:
        entry = plan[config.name]
        bits = BITS.get(config.data_type)
        for shard in entry.shards or []:
            col, width = shard.shard_offsets[1], shard.shard_sizes[1]
            if bits and (col * bits % 8 or width * bits % 8):
                raise ValueError(
                    f"table '{config.name}': a column shard at column {col} of width {width} "
                    f"splits a byte of packed {config.data_type.value} values; shard at "
                    f"multiples of {8 // bits} columns"
                )


def placeholder_specs(configs: List[BaseEmbeddingConfig], plan: EmbeddingModuleShardingPlan,
                      output_dtype: torch.dtype) -> List[TableSpec]:
    """Float specs with the dense kernel, in the output dtype, to build the shardings from."""
    return [
        TableSpec(dataclasses.replace(c, data_type=_PLACEHOLDER_TYPES[output_dtype]),
                  dataclasses.replace(plan[c.name],
                                      compute_kernel=EmbeddingComputeKernel.DENSE.value))
        for c in configs
    ]


def swap_in_quant_lookups(
    shardings: Dict[str, EmbeddingSharding], configs: List[BaseEmbeddingConfig], pooled: bool,
    device: torch.device, output_dtype: torch.dtype,
) -> None:
    """Replace every sharding's placeholder lookup by a quantized one over the same shards."""
    by_name = {c.name: c for c in configs}
    for sharding in shardings.values():
        tables = [dataclasses.replace(t, config=by_name[t.name],
                                      compute_kernel=EmbeddingComputeKernel.QUANT)
                  for t in sharding.lookup.tables]
        sharding.lookup = QuantShardLookup(tables, pooled, device, output_dtype)


def load_quant_shards(shardings: Dict[str, EmbeddingSharding], full: QuantizedWeights,
                      device: torch.device) -> None:
    """Copy this rank's rows (and packed columns) out of the unsharded quantized tables."""
    for sharding in shardings.values():
        for kernel in sharding.lookup.kernels:  # one kernel holding every local shard
            for index, local in enumerate(sharding.lookup.tables):
                values, scale_bias = full[local.name]
                rows = slice(local.row_offset, local.row_offset + local.rows)
                per_byte = 8 // BITS.get(local.config.data_type, 8)  # packed columns
                cols = slice(local.col_offset // per_byte,
                             (local.col_offset + local.cols) // per_byte)
                kernel.load_quantized(
                    index, values[rows, cols].to(device),
                    None if scale_bias is None else scale_bias[rows].to(device),
                )


class QuantSharder(ModuleSharder[nn.Module]):
    """What the quantized collections' sharders share: the quant kernel, and `shard` building
    `sharded_type(module, plan, env, device, fused_params, qcomm_codecs_registry)`."""

    sharded_type: type

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.QUANT.value]

    def shard(
        self,
        module: nn.Module,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedModule:
        return self.sharded_type(
            module, params, env, device, self.fused_params, self.qcomm_codecs_registry
        )
