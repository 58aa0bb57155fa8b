"""The quantized lookup: fbgemm's IntNBitTableBatchedEmbeddingBagsCodegen over several tables.

Input: a KJT whose keys are the tables' features, table by table (stride B).
Output: pooled `[B, sum of the features' dims]` (MEAN features divided by their bag length,
as the float `EmbeddingBagCollection` does), or sequence `[N, D]`, one row per id.

Inference only: no backward, no optimizer. Weights live in fbgemm's byte buffer; each
table's rows are exposed as views (`values`, `scale_bias`) so loading and state_dict work
in place. fbgemm crashes on tables with no rows (a row-wise shard of a tiny table), so such a
table gets one zero row that no id can reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
from torch import nn

from recshard.modules.embedding_configs import DataType, PoolingType
from recshard.quant.fake_classes import register_fake_classes
from recshard.quant.rowwise import check_table_layout, data_bytes, quantize_rows
from recshard.sparse import KeyedJaggedTensor

OUTPUT_DTYPES = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16"}


@dataclass
class QuantTable:
    """One table (or table shard) as the quantized kernel holds it."""

    name: str
    rows: int
    dim: int
    data_type: DataType
    feature_names: List[str]
    pooling: PoolingType = PoolingType.SUM


def _sparse_type(data_type: DataType):  # noqa: ANN202 - fbgemm's SparseType
    from fbgemm_gpu.split_embedding_configs import SparseType

    return SparseType(data_type.value.lower())


def check_output_dtype(output_dtype: torch.dtype) -> None:
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(
            f"output_dtype {output_dtype} is not supported by the quantized kernel; choose one "
            f"of {list(OUTPUT_DTYPES)}"
        )


class QuantLookup(nn.Module):
    """One fbgemm inference TBE for `tables` (pooled: SUM kernel, MEAN divided afterwards)."""

    is_fused = False  # nothing to optimize: inference only

    def __init__(
        self,
        tables: List[QuantTable],
        pooled: bool,
        device: torch.device | None = None,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
            IntNBitTableBatchedEmbeddingBagsCodegen,
        )

        if not tables:
            raise ValueError("QuantLookup needs at least one table")
        check_output_dtype(output_dtype)
        for table in tables:
            check_table_layout(table.name, table.dim, table.data_type)
        if not pooled and len({t.dim for t in tables}) > 1:
            raise ValueError(
                f"sequence lookups need one dim per kernel, got {[(t.name, t.dim) for t in tables]}"
            )
        device = torch.device(device or "cpu")
        on_cuda = device.type == "cuda"
        self.tables = list(tables)
        self.pooled = pooled
        self.output_dtype = output_dtype
        self.feature_dims = [t.dim for t in tables for _ in t.feature_names]
        self._mean_columns = [
            t.pooling == PoolingType.MEAN for t in tables for _ in t.feature_names
        ]
        location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        self.tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            [(t.name, max(t.rows, 1), t.dim, _sparse_type(t.data_type), location) for t in tables],
            feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
            pooling_mode=PoolingMode.SUM if pooled else PoolingMode.NONE,
            device=device,
            # ids are checked before they get here (the modules' bounds-check modes)
            bounds_check_mode=BoundsCheckMode.NONE,
            output_dtype=SparseType(OUTPUT_DTYPES[output_dtype].lower()),
            # 16 is what fbgemm's CUDA kernel expects; 2 on CPU keeps fp16 scale/bias aligned
            row_alignment=16 if on_cuda else 2,
        )
        self.tbe.initialize_weights()
        register_fake_classes()  # lets torch.export trace the TBE's script objects
        # fbgemm's buffers follow from the tables; the weights are saved through the
        # collections' per-table views, so keep these out of state_dict.
        self.tbe._non_persistent_buffers_set.update(self.tbe._buffers)

    @property
    def feature_names(self) -> List[str]:
        return [f for t in self.tables for f in t.feature_names]

    def storage(self) -> List[Tuple[torch.Tensor, torch.Tensor | None]]:
        """Per table, views of its rows: values (`uint8 [rows, D*bits/8]`, or `[rows, D]` fp16 /
        fp32) and scale_bias (`fp16 [rows, 2]`: scale, bias; None for float types)."""
        out = []
        for table, (values, scale_bias) in zip(self.tables, self.tbe.split_embedding_weights()):
            values = values[: table.rows, : data_bytes(table.dim, table.data_type)]
            if table.data_type == DataType.FP16:
                values = values.view(torch.float16)
            elif table.data_type == DataType.FP32:
                values = values.view(torch.float32)
            if scale_bias is not None:
                scale_bias = scale_bias[: table.rows].view(torch.float16)
            out.append((values, scale_bias))
        return out

    def storage_bytes(self) -> int:
        """Bytes of fbgemm's weight buffer (rows, scale/bias, row and table padding)."""
        return sum(
            t.numel() for t in (self.tbe.weights_host, self.tbe.weights_dev, self.tbe.weights_uvm)
        )

    def load_float(self, index: int, weight: torch.Tensor) -> None:
        """Quantize float rows `[rows, D]` into table `index`."""
        table = self.tables[index]
        values, scale_bias = quantize_rows(weight, table.data_type, table.name)
        self.load_quantized(index, values, scale_bias)

    def load_quantized(
        self, index: int, values: torch.Tensor, scale_bias: torch.Tensor | None
    ) -> None:
        """Copy already quantized rows (as `storage()` lays them out) into table `index`."""
        table = self.tables[index]
        dest_values, dest_scale_bias = self.storage()[index]
        if tuple(values.shape) != tuple(dest_values.shape):
            raise ValueError(
                f"table '{table.name}': expected {table.data_type.value} rows of shape "
                f"{tuple(dest_values.shape)}, got {tuple(values.shape)}"
            )
        with torch.no_grad():
            dest_values.copy_(values)
            if dest_scale_bias is not None:
                if scale_bias is None:
                    raise ValueError(
                        f"table '{table.name}': {table.data_type.value} rows need scale_bias"
                    )
                dest_scale_bias.copy_(scale_bias)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        values, offsets = features.values(), features.offsets()
        if values.dtype != offsets.dtype:
            values, offsets = values.long(), offsets.long()
        weights = features.weights_or_none()
        out = self.tbe(
            values, offsets, per_sample_weights=None if weights is None else weights.float()
        )
        if self.pooled and any(self._mean_columns):
            out = out / self._mean_divisor(features, out.dtype)
        return out

    def _mean_divisor(self, features: KeyedJaggedTensor, dtype: torch.dtype) -> torch.Tensor:
        """`[B, sum dims]`: each MEAN feature's bag lengths (at least 1) over its columns."""
        lengths = features.lengths().view(len(self.feature_dims), -1).t().to(dtype)
        lengths = lengths.clamp(min=1)
        mean = torch.tensor(self._mean_columns, device=lengths.device)
        lengths = torch.where(mean, lengths, torch.ones_like(lengths))
        dims = torch.tensor(self.feature_dims, device=lengths.device)
        return lengths.repeat_interleave(dims, dim=1)
