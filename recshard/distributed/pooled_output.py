"""The output side of sharded pooled collections (float and quantized): laying the shardings'
outputs out in the module's key order, as a `KeyedTensor`.

The columns the module wants are blocks of the shardings' concatenated outputs (adjacent
columns merged). With a single table/column-wise sharding, its pooled all-to-all delivers
the columns in module order straight from its receive buffer (`take_column_order`): one copy
each way. Otherwise the outputs are concatenated and `chunks_to_columns` reorders the blocks
(one more copy each way). When the shardings already produce the module's order, nothing is
copied.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from recshard.comm.column_blocks import Block, check_blocks, chunks_to_columns, cut_at_chunks
from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.distributed.variable_batch_output import (
    VariableBatchOutput,
    expand_rows,
    needs_variable_batch_output,
)
from recshard.sharding.common import EmbeddingSharding
from recshard.sparse import KeyedTensor
from recshard.types import Awaitable, LazyAwaitable


class PooledOutputLayout:
    """Where the module's columns sit in its shardings' concatenated outputs."""

    def __init__(
        self,
        shardings: List[EmbeddingSharding],
        embedding_names: List[str],
        embedding_dims: List[int],
    ) -> None:
        self.embedding_names, self.embedding_dims = embedding_names, embedding_dims
        self.column_blocks = _output_order(shardings, embedding_names, embedding_dims)


def _output_order(
    shardings: List[EmbeddingSharding], embedding_names: List[str], embedding_dims: List[int]
) -> List[Block] | None:
    """Blocks taking the concatenated sharding outputs to the module's column order, or None
    when nothing is left to reorder (already in order, or a single sharding took the order
    into its all-to-all)."""
    where: Dict[Tuple[str, int], int] = {}
    position = 0
    for sharding in shardings:
        for feature, col_offset, width in sharding.output_columns:
            for c in range(width):
                where[(feature, col_offset + c)] = position + c
            position += width
    order = [where[(f, c)] for f, d in zip(embedding_names, embedding_dims) for c in range(d)]
    if order == list(range(len(order))):
        return None
    spans: List[List[int]] = []  # [input start, width], in output order
    for column in order:
        if spans and spans[-1][0] + spans[-1][1] == column:
            spans[-1][1] += 1
        else:
            spans.append([column, 1])
    only = shardings[0] if len(shardings) == 1 else None
    if only is not None and getattr(only, "take_column_order", lambda _: False)(spans):
        return None
    return check_blocks(cut_at_chunks(spans, [len(order)]), [len(order)])


class _VariableBatchAwaitable(LazyAwaitable[KeyedTensor]):
    """Waits every sharding's output dist; a variable batch per feature or inverse indices
    brought to the module's `KeyedTensor` (`variable_batch_output.py`)."""

    def __init__(
        self,
        pending: List[Awaitable[torch.Tensor]],
        layout: PooledOutputLayout,
        ctx: EmbeddingModuleContext,
        variable_batch: VariableBatchOutput,
    ) -> None:
        super().__init__()
        self._pending, self._layout, self._ctx = pending, layout, ctx
        self._variable_batch = variable_batch

    def _wait_impl(self) -> KeyedTensor:
        layout, ctx = self._layout, self._ctx
        parts = [p.wait() for p in self._pending]
        if any(c.variable_batch_per_feature for c in ctx.sharding_contexts):
            values = self._variable_batch(parts, ctx.sharding_contexts, ctx.inverse_indices)
        else:  # a fixed batch with inverse indices: the usual layout, then its rows expanded
            values = expand_rows(
                _in_module_order(parts, layout),
                layout.embedding_dims,
                self._variable_batch.embedding_features,
                ctx.inverse_indices,
            )
        return KeyedTensor(layout.embedding_names, layout.embedding_dims, values)


class _KeyedTensorAwaitable(LazyAwaitable[KeyedTensor]):
    """Waits every sharding's output dist and lays the columns out in module key order."""

    def __init__(self, pending: List[Awaitable[torch.Tensor]], layout: PooledOutputLayout) -> None:
        super().__init__()
        self._pending = pending
        self._layout = layout

    def _wait_impl(self) -> KeyedTensor:
        layout = self._layout
        values = _in_module_order([p.wait() for p in self._pending], layout)
        return KeyedTensor(layout.embedding_names, layout.embedding_dims, values)


def _in_module_order(parts: List[torch.Tensor], layout: PooledOutputLayout) -> torch.Tensor:
    """`[B, sum of dims]`: the shardings' `[B, cols]` outputs, columns in module key order."""
    values = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if layout.column_blocks is not None:
        values = chunks_to_columns(
            values.reshape(-1), values.size(0), [values.size(1)], layout.column_blocks
        )
    return values


def pooled_output_dist(
    shardings: List[EmbeddingSharding],
    layout: PooledOutputLayout,
    ctx: EmbeddingModuleContext,
    output: List[torch.Tensor],
    variable_batch: VariableBatchOutput | None = None,
) -> LazyAwaitable[KeyedTensor]:
    """Start every sharding's output dist; the wait gives the module's `KeyedTensor`
    (expanded by the batch's inverse indices, in modules that take `variable_batch`)."""
    pending = [
        s.output_dist(local, sharding_ctx)
        for s, sharding_ctx, local in zip(shardings, ctx.sharding_contexts, output)
    ]
    if variable_batch is not None and needs_variable_batch_output(ctx):
        return _VariableBatchAwaitable(pending, layout, ctx, variable_batch)
    return _KeyedTensorAwaitable(pending, layout)
