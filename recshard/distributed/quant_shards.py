"""What the sharded quantized collections share: their table storage (`QuantTables`), the
quantized lookup each sharding is built with, and the plan rule of packed columns.

A sharded quantized collection is its float twin (same routing, shardings and output dists)
built with `QuantTables`: each sharding's lookup is a `QuantShardLookup` (one fbgemm IntN TBE
over this rank's shards), filled with this rank's slice of the already quantized rows: row
shards take their rows, column shards their packed columns with the full row's scale/bias, so
every shard dequantizes to exactly what the unsharded quantized module reads.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from recshard.distributed.module_state import ShardedEmbeddingModule, TableStorage
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.quant.embedding_modules import QuantizedWeights
from recshard.quant.kernel import QuantLookup, QuantTable
from recshard.quant.rowwise import BITS
from recshard.sharding.common import TableSpec
from recshard.sparse import KeyedJaggedTensor
from recshard.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
)

QUANT_KERNELS = [EmbeddingComputeKernel.QUANT.value]


class QuantShardLookup(nn.Module):
    """A sharding's local lookup over quantized shards (the `Lookup` contract), all in one
    kernel, in the order given.

    Input: KJT with keys `[f for t in self.tables for f in t.feature_names]`.
    Output: pooled `[B, sum of those features' local dims]`, or sequence `[N, D]`, in
    `output_dtype`.
    """

    def __init__(
        self,
        tables: List[LocalTable],
        pooled: bool,
        device: torch.device,
        output_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.tables = tables
        self._pooled, self._device, self._output_dtype = pooled, device, output_dtype
        quant_tables = [
            QuantTable(t.name, t.rows, t.cols, t.config.data_type, t.feature_names, t.pooling)
            for t in tables
        ]
        self.kernels = nn.ModuleList(
            [QuantLookup(quant_tables, pooled, device, output_dtype)] if tables else []
        )

    def table_weights(self) -> List[torch.Tensor]:
        """Each local shard's stored values (packed codes or fp16/fp32 rows), views."""
        return [values for k in self.kernels for values, _ in k.storage()]

    def table_scale_bias(self) -> List[torch.Tensor | None]:
        """Each local shard's row scale and bias (`fp16 [rows, 2]`; None for float types)."""
        return [scale_bias for k in self.kernels for _, scale_bias in k.storage()]

    def load_slices(self, full: QuantizedWeights) -> None:
        """Copy each local shard's rows (and packed columns) out of the unsharded quantized
        tables `full` (tables not in it keep their rows)."""
        for kernel in self.kernels:  # one kernel holding every local shard
            for index, local in enumerate(self.tables):
                if local.name not in full:
                    continue
                values, scale_bias = full[local.name]
                rows = slice(local.row_offset, local.row_offset + local.rows)
                per_byte = 8 // BITS.get(local.config.data_type, 8)  # packed columns
                cols = slice(
                    local.col_offset // per_byte, (local.col_offset + local.cols) // per_byte
                )
                kernel.load_quantized(
                    index,
                    values[rows, cols].to(self._device),
                    None if scale_bias is None else scale_bias[rows].to(self._device),
                )

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if not self.kernels:
            shape = (features.stride(), 0) if self._pooled else (features.values().numel(), 0)
            return torch.empty(*shape, dtype=self._output_dtype, device=self._device)
        return self.kernels[0](features)


def check_packed_columns(
    configs: List[BaseEmbeddingConfig], plan: EmbeddingModuleShardingPlan
) -> None:
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


class QuantTables(TableStorage):
    """Quantized tables, for inference: plans name the 'quant' kernel and cut columns at whole
    bytes, each sharding looks up its shards with a `QuantShardLookup` that returns rows in the
    unsharded module's `output_dtype`, and the shards start as slices of its quantized rows.
    No backward, no optimizer."""

    compute_kernels = QUANT_KERNELS

    def __init__(self, module: nn.Module) -> None:
        """`module`: a `QuantEmbeddingBagCollection` or `QuantEmbeddingCollection`."""
        self.output_dtype: torch.dtype = module.output_dtype()

    def check_plan(
        self, configs: List[BaseEmbeddingConfig], table_plans: EmbeddingModuleShardingPlan
    ) -> None:
        check_packed_columns(configs, table_plans)

    def table_specs(self, sharded: ShardedEmbeddingModule, module: nn.Module) -> List[TableSpec]:
        return [
            TableSpec(c, sharded.table_plan(c.name), output_dtype=self.output_dtype)
            for c in sharded.table_configs()
        ]

    def make_lookup(
        self, tables: List[LocalTable], pooled: bool, device: torch.device, is_weighted: bool
    ) -> QuantShardLookup:
        return QuantShardLookup(tables, pooled, device, self.output_dtype)

    def load(self, sharded: ShardedEmbeddingModule, module: nn.Module) -> None:
        full = module.quantized_weights()
        for sharding in sharded.shardings.values():
            lookup = sharding.lookup
            assert isinstance(lookup, QuantShardLookup), type(lookup)  # made by make_lookup
            lookup.load_slices(full)
