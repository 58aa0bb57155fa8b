"""Grouped lookup: the local table shards of one sharding, one kernel per group.

Tables are grouped by (dtype, pooling, compute kernel, implementation, fused params) and
reordered so each group's features are contiguous; the sharding routes features to this rank
in `GroupedLookup.tables` order, so the incoming KJT splits into groups without a permute.

On CPU with several torch threads (`torch.get_num_threads()` when the lookup is built) a
fbgemm group is cut into `KERNELS_PER_THREAD` kernels per thread and the fused kernels run
side by side (`recshard.lookup.threads`): fbgemm's CPU backward and fused update use one
thread per kernel, and the extra kernels let the threads share uneven tables evenly. The cut
never reorders features; dense kernels always run on the caller's thread.

A fused group that recshard's own C++ kernel covers (CPU, pooled, fp32, exact row-wise
Adagrad: `native_kernel.covers`) runs it instead of fbgemm's or the torch kernel; the grouping
is the same either way.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from recshard.comm import buffers
from recshard.lookup import native_kernel
from recshard.lookup.fused_params import check_backend
from recshard.lookup.heap import keep_step_buffers_in_heap, leave_heap_to_glibc
from recshard.lookup.kernels import DenseKernel, FbgemmFusedKernel, LookupKernel, TorchFusedKernel
from recshard.lookup.key_value import KeyValueKernel
from recshard.lookup.native_kernel import NativeFusedKernel
from recshard.lookup.tables import LocalTable, group_key
from recshard.lookup.threads import run_side_by_side
from recshard.lookup.variable_batch import join_rank_major
from recshard.modules.embedding_configs import DataType, PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from recshard.types import EmbeddingComputeKernel

_FBGEMM_DTYPES = (DataType.FP32, DataType.FP16)
# Kernels per torch thread when a rank has several: more even work per thread, at ~0.1 ms
# of fbgemm call overhead per extra kernel and pass.
KERNELS_PER_THREAD = 2


def uses_fbgemm(table: LocalTable, is_weighted: bool) -> bool:
    """fbgemm's TBE runs this shard: fused kernel, dim a multiple of 4, fp32/fp16.

    The choice depends only on table-level facts (never on a shard's row count), so every
    rank derives the same grouping, hence the same feature order, for every other rank.

    Key-value tables run `KeyValueKernel`. Stay on the torch kernel: weighted MEAN tables (fbgemm
    1.8's backward for them omits the 1/length its forward applies). A shard with no rows stays in
    fbgemm (`FbgemmFusedKernel` gives it a phantom row), so tiny row-wise tables cost no second
    kernel, no join of the kernels' outputs and no reordering of the output's columns.
    """
    return (
        table.compute_kernel not in (EmbeddingComputeKernel.DENSE, EmbeddingComputeKernel.KEY_VALUE)
        and not (is_weighted and table.pooling == PoolingType.MEAN)
        and ops.fbgemm_available()
        and table.cols % 4 == 0
        and table.config.data_type in _FBGEMM_DTYPES
    )


def _build_kernel(
    tables: List[LocalTable], pooled: bool, fbgemm: bool, device: torch.device
) -> LookupKernel:
    if tables[0].compute_kernel == EmbeddingComputeKernel.DENSE:
        return DenseKernel(tables, pooled, device)
    spec = tables[0].fused_params.optim
    check_backend(spec, tables[0].name, fbgemm and device.type == "cuda")
    if tables[0].compute_kernel == EmbeddingComputeKernel.KEY_VALUE:
        return KeyValueKernel(tables, pooled, spec, device)
    if native_kernel.covers(tables, pooled, spec, device):
        return NativeFusedKernel(tables, pooled, spec, device)
    if fbgemm:
        return FbgemmFusedKernel(tables, pooled, spec, device)
    return TorchFusedKernel(tables, pooled, spec, device)


def group_tables(
    tables: List[LocalTable], is_weighted: bool
) -> List[Tuple[bool, List[LocalTable]]]:
    """Tables grouped by `group_key`, groups in order of first appearance: (fbgemm?, tables)."""
    groups: Dict[Tuple, List[LocalTable]] = {}
    for table in tables:
        groups.setdefault(group_key(table, uses_fbgemm(table, is_weighted)), []).append(table)
    return [(key[3], group) for key, group in groups.items()]


def split_evenly(tables: List[LocalTable], parts: int) -> List[List[LocalTable]]:
    """At most `parts` contiguous runs of `tables` with about equal feature counts each."""
    total = sum(t.num_features for t in tables)
    runs: List[List[LocalTable]] = [[] for _ in range(min(parts, len(tables)))]
    seen = 0
    for table in tables:
        runs[min(len(runs) - 1, seen * len(runs) // total)].append(table)
        seen += table.num_features
    return [run for run in runs if run]


def lookup_order(tables: List[LocalTable], is_weighted: bool) -> List[LocalTable]:
    """The order in which `GroupedLookup` expects these tables' features."""
    return [t for _, group in group_tables(tables, is_weighted) for t in group]


class _JoinColumns(torch.autograd.Function):
    """`torch.cat(outputs, dim=1)` into a buffer reused across steps (`recshard.comm.buffers`):
    the kernels' pooled outputs side by side; backward hands each its columns, as cat's does."""

    @staticmethod
    def forward(ctx, *outputs: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        widths = [out.size(1) for out in outputs]
        ctx.widths = widths
        rows, first = outputs[0].size(0), outputs[0]
        joined = buffers.take("lookup_columns", rows * sum(widths), first.dtype, first.device)
        joined = joined.view(rows, sum(widths))
        torch.cat(outputs, dim=1, out=joined)
        return joined

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return tuple(grad.split(ctx.widths, dim=1))


class GroupedLookup(nn.Module):
    """Looks up all local shards of a sharding.

    Input: KJT with keys `[f for t in self.tables for f in t.feature_names]`.
    Output: pooled `[B, sum of those features' local dims]`; sequence `[N, D]`.
    """

    def __init__(
        self,
        tables: List[LocalTable],
        pooled: bool,
        device: torch.device,
        is_weighted: bool = False,
    ) -> None:
        super().__init__()
        self.pooled = pooled
        threads = torch.get_num_threads() if device.type == "cpu" else 1
        self.kernels = nn.ModuleList(
            _build_kernel(run, pooled, fbgemm, device)
            for fbgemm, group in group_tables(tables, is_weighted)
            for run in (
                split_evenly(group, threads * KERNELS_PER_THREAD if threads > 1 else 1)
                if fbgemm
                else [group]
            )
        )
        self.side_by_side = threads > 1 and sum(k.is_fused for k in self.kernels) > 1
        self.tables: List[LocalTable] = [t for k in self.kernels for t in k.tables]
        self._features_per_kernel = [len(k.feature_table) for k in self.kernels]
        if any(isinstance(k, KeyValueKernel) for k in self.kernels):
            leave_heap_to_glibc()  # held to a DRAM budget: freed temporaries go back
        elif device.type == "cpu":  # after the weights: tables keep their own mappings
            keep_step_buffers_in_heap()

    @property
    def feature_names(self) -> List[str]:
        return [f for t in self.tables for f in t.feature_names]

    @property
    def feature_dims(self) -> List[int]:
        return [t.cols for t in self.tables for _ in t.feature_names]

    def table_weights(self) -> List[torch.Tensor]:
        """Local shard weights in `self.tables` order."""
        return [w for k in self.kernels for w in k.table_weights()]

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Bring the rows `features` read into the key-value kernels' caches (others: no-op)."""
        parts = features.split(self._features_per_kernel) if self.kernels else []
        for kernel, part in zip(self.kernels, parts):
            if isinstance(kernel, KeyValueKernel):
                kernel.prefetch(part)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """Pooled `[B, sum of dims]` (a variable batch per feature: flat, rank-major, see
        `recshard.lookup.variable_batch`) or sequence `[N, D]`."""
        variable = self.pooled and features.variable_stride_per_key()
        if len(self.kernels) == 1:
            return self.kernels[0](features)
        if not self.kernels:
            device = features.device()
            return (
                torch.empty(0, device=device)
                if variable
                else torch.empty(features.stride(), 0, device=device)
            )
        parts = features.split(self._features_per_kernel)
        weights = features.weights_or_none()
        if self.side_by_side and (weights is None or not weights.requires_grad):
            outputs = self._fused_side_by_side(parts)
        else:
            outputs = [kernel(part) for kernel, part in zip(self.kernels, parts)]
        if variable:
            return join_rank_major(
                outputs,
                [part.stride_per_key_per_rank() for part in parts],
                [kernel.feature_dims for kernel in self.kernels],
            )
        if self.pooled and len({out.dtype for out in outputs}) == 1:
            return _JoinColumns.apply(*outputs)
        return torch.cat(outputs, dim=1 if self.pooled else 0)

    def _fused_side_by_side(self, parts: List[KeyedJaggedTensor]) -> List[torch.Tensor]:
        """Fused kernels on torch's threads, the others on this one; outputs in kernel order."""
        fused = [i for i, kernel in enumerate(self.kernels) if kernel.is_fused]
        outputs = dict(
            zip(
                fused,
                run_side_by_side(
                    [self.kernels[i] for i in fused],
                    [parts[i] for i in fused],
                    [parts[i].values().numel() for i in fused],
                ),
            )
        )
        return [
            outputs[i] if i in outputs else kernel(parts[i])
            for i, kernel in enumerate(self.kernels)
        ]
