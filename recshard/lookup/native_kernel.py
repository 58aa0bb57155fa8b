"""The fused kernel on recshard's own C++ CPU embedding-bag code (`recshard.lookup.native_tbe`).

Same contract as `TorchFusedKernel` (weights are buffers updated during backward; it reuses
that kernel's autograd function), with every table's rows back to back in one fp32 buffer on
huge pages and the row-wise Adagrad accumulators (if any) in another, so one C++ call looks up
every feature and one updates every table. It covers CPU, pooled SUM/MEAN, fp32 weights and
exact row-wise Adagrad or exact SGD (`covers`); lookups it does not take at run time (a
variable batch per feature, per-sample weights other than fp32) run the torch kernel's code on
the same buffers, so results never depend on the path.

`RECSHARD_NATIVE_KERNEL=0` (read when a lookup is built; for comparisons only) leaves every group
to fbgemm's kernel or the torch one, as when the library is missing.
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch

from recshard.lookup import native_tbe
from recshard.lookup.fused_params import FusedOptimSpec, OptimType
from recshard.lookup.huge_pages import huge_page_zeros
from recshard.lookup.kernels import LookupKernel, TorchFusedKernel
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import DataType, PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.types import EmbeddingComputeKernel

ENV = "RECSHARD_NATIVE_KERNEL"
_MAX_ROWS = native_tbe.MAX_POSITIONS
_NATIVE_POOLINGS = (PoolingType.SUM, PoolingType.MEAN)
_NATIVE_OPTIMS = (OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.EXACT_SGD)


def covers(
    tables: List[LocalTable], pooled: bool, spec: FusedOptimSpec, device: torch.device
) -> bool:
    """True when `NativeFusedKernel` can run this group and the C++ library loaded (the
    first call without it warns once), unless `RECSHARD_NATIVE_KERNEL=0`."""
    return all(
        t.compute_kernel not in (EmbeddingComputeKernel.DENSE, EmbeddingComputeKernel.KEY_VALUE)
        for t in tables
    ) and computes(tables, pooled, spec, device, sum(t.rows for t in tables))


def computes(
    tables: List[LocalTable], pooled: bool, spec: FusedOptimSpec, device: torch.device, rows: int
) -> bool:
    """True when the C++ calls can look up and update these tables' `rows` rows held back to
    back (a key_value group's cache slots, or an in-memory group's rows), unless
    `RECSHARD_NATIVE_KERNEL=0`."""
    return (
        os.environ.get(ENV, "1") != "0"
        and device.type == "cpu"
        and pooled
        and spec.optim in _NATIVE_OPTIMS
        and all(
            t.config.data_type == DataType.FP32 and t.pooling in _NATIVE_POOLINGS for t in tables
        )
        and rows < _MAX_ROWS
        and native_tbe.available()
    )


def native_ids(features: KeyedJaggedTensor, layout: native_tbe.TableLayout) -> tuple | None:
    """(indices, offsets, per-sample weights) for the C++ calls; None where they run the
    torch kernel's code instead."""
    weights = features.weights_or_none()
    if features.variable_stride_per_key() or (
        weights is not None and weights.dtype != torch.float32
    ):
        return None
    indices, offsets = features.values(), features.offsets()
    if (
        indices.numel() >= _MAX_ROWS
        or features.stride() * layout.width > native_tbe.MAX_GRAD_FLOATS
    ):
        return None
    first = int(offsets[0]) if offsets.numel() else 0
    if first:  # ids of a slice: the C++ side counts positions from 0
        offsets = offsets - first
        indices = indices[first:]
        weights = None if weights is None else weights[first:]
    weights = None if weights is None else weights.detach().contiguous()
    return indices.contiguous(), offsets.contiguous(), weights


def native_lookup(
    kernel: LookupKernel,
    weights: torch.Tensor,
    layout: native_tbe.TableLayout,
    features: KeyedJaggedTensor,
    ids: tuple,
) -> torch.Tensor:
    """`kernel`'s pooled lookup of `features` (`ids` from `native_ids`) on the C++ side, rows
    in `weights` as `layout` places them; errors name `kernel`'s table and feature."""
    mean = kernel.pooling == PoolingType.MEAN
    try:
        return native_tbe.forward(weights, layout, *ids, mean, features.stride())
    except native_tbe.IdOutOfRange as error:
        raise _out_of_range(kernel, features, ids, error.position) from None
    except native_tbe.OffsetsDecrease as error:
        raise _offsets_decrease(kernel, features, error) from None


def native_update(
    kernel: LookupKernel,
    weights: torch.Tensor,
    momentum: torch.Tensor | None,
    layout: native_tbe.TableLayout,
    features: KeyedJaggedTensor,
    ids: tuple,
    grad_output: torch.Tensor,
    weights_grad: bool,
) -> torch.Tensor | None:
    """`kernel`'s fused update (its `lr`, `spec`) of `weights` and `momentum` in place from the
    pooled output's gradient; the per-sample weights' gradient with `weights_grad`."""
    try:
        return native_tbe.backward(
            weights,
            momentum,
            layout,
            *ids,
            kernel.pooling == PoolingType.MEAN,
            grad_output,
            kernel.lr,
            kernel.spec.eps,
            weights_grad,
        )
    except native_tbe.IdOutOfRange as error:
        raise _out_of_range(kernel, features, ids, error.position) from None
    except native_tbe.OffsetsDecrease as error:
        raise _offsets_decrease(kernel, features, error) from None


def _offsets_decrease(
    kernel: LookupKernel, features: KeyedJaggedTensor, error: native_tbe.OffsetsDecrease
) -> ValueError:
    """The error for bag offsets that go down (given by the caller beside lengths, which
    the input checks compare only in `validate()`), naming table and feature."""
    feature = error.bag // max(features.stride(), 1)
    table = kernel.tables[kernel.feature_table[feature]]
    return ValueError(f"table '{table.name}', feature '{features.keys()[feature]}': {error}")


def _out_of_range(
    kernel: LookupKernel, features: KeyedJaggedTensor, ids: tuple, position: int
) -> ValueError:
    """The error for an id outside its table (possible only with bounds_check_mode NONE,
    which skips recshard's check before the input dist), naming table, feature and id."""
    indices, offsets, _ = ids
    feature = int(torch.searchsorted(offsets, position, right=True)) - 1
    feature //= max(features.stride(), 1)
    table = kernel.tables[kernel.feature_table[feature]]
    return ValueError(
        f"table '{table.name}', feature '{features.keys()[feature]}': id "
        f"{int(indices[position])} is outside the shard's rows [0, {table.rows}) "
        "(bounds_check_mode=NONE skips the check that would have named it earlier)"
    )


class NativeFusedKernel(TorchFusedKernel):
    """One C++ forward and one C++ backward-with-update per step for the whole group."""

    def _allocate(self, device: torch.device) -> None:
        rows = [t.rows for t in self.tables]
        dims = [t.cols for t in self.tables]
        self.layout = native_tbe.TableLayout.of(rows, dims, self.feature_table)
        weights = huge_page_zeros(sum(n * d for n, d in zip(rows, dims)), torch.float32)
        self.register_buffer("weights", weights)
        rowwise = self.spec.optim == OptimType.EXACT_ROWWISE_ADAGRAD  # SGD has no state
        momentum = huge_page_zeros(sum(rows), torch.float32) if rowwise else None
        self.register_buffer("momentum1", momentum)

    def table_weights(self) -> List[torch.Tensor]:
        starts = self.layout.weight_start.tolist()
        return [
            self.weights[start : start + t.rows * t.cols].view(t.rows, t.cols)
            for start, t in zip(starts, self.tables)
        ]

    def optimizer_states(self) -> List[Dict[str, torch.Tensor]]:
        starts = self.layout.row_start.tolist()
        if self.momentum1 is None:  # SGD: no state, as fbgemm's and the torch kernel's
            return [{} for _ in self.tables]
        return [{"momentum1": self.momentum1[a:b]} for a, b in zip(starts, starts[1:])]

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        ids = native_ids(features, self.layout)
        if ids is None:
            return super().lookup(features)
        return native_lookup(self, self.weights, self.layout, features, ids)

    def update(
        self, features: KeyedJaggedTensor, grad_output: torch.Tensor, weights_grad: bool = False
    ) -> torch.Tensor | None:
        ids = native_ids(features, self.layout)
        if ids is None:
            return super().update(features, grad_output, weights_grad)
        return native_update(
            self,
            self.weights,
            self.momentum1,
            self.layout,
            features,
            ids,
            grad_output,
            weights_grad,
        )
