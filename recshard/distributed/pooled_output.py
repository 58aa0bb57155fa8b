"""What sharded pooled collections (float and quantized) share on the output side: laying
the shardings' outputs out in the module's key order.

The columns the module wants are blocks of the shardings' concatenated outputs (adjacent
columns merged). With a single table/column-wise sharding, its pooled all-to-all delivers
the columns in module order straight from its receive buffer (`take_column_order`): one copy
each way. Otherwise the outputs are concatenated and `chunks_to_columns` reorders the blocks
(one more copy each way). When the shardings already produce the module's order, nothing is
copied.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from recshard.comm.column_blocks import Block, check_blocks, chunks_to_columns, cut_at_chunks
from recshard.distributed.module_state import EmbeddingModuleContext
from recshard.sparse import KeyedTensor
from recshard.types import Awaitable, LazyAwaitable


class _KeyedTensorAwaitable(LazyAwaitable[KeyedTensor]):
    """Waits every sharding's output dist and lays the columns out in module key order."""

    def __init__(self, pending: List[Awaitable[torch.Tensor]], module: PooledOutputMixin) -> None:
        super().__init__()
        self._pending = pending
        self._module = module

    def _wait_impl(self) -> KeyedTensor:
        module = self._module
        parts = [p.wait() for p in self._pending]
        values = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if module._column_blocks is not None:
            values = chunks_to_columns(values.reshape(-1), values.size(0), [values.size(1)],
                                       module._column_blocks)
        return KeyedTensor(module._feature_names, module._feature_dims, values)


class PooledOutputMixin:
    """Needs `_shardings`, `_feature_names`, `_feature_dims`, `_configs`, `_is_weighted`;
    set `_column_blocks = self._output_order()` once the shardings exist."""

    def _output_order(self) -> Optional[List[Block]]:
        """Blocks taking the concatenated sharding outputs to the module's column order, or
        None when nothing is left to reorder (already in order, or a single sharding took
        the order into its all-to-all)."""
        where: Dict[Tuple[str, int], int] = {}
        position = 0
        for sharding in self._shardings.values():
            for feature, col_offset, width in sharding.output_columns:
                for c in range(width):
                    where[(feature, col_offset + c)] = position + c
                position += width
        order = [where[(f, c)] for f, d in zip(self._feature_names, self._feature_dims) for c in range(d)]
        if order == list(range(len(order))):
            return None
        spans: List[List[int]] = []  # [input start, width], in output order
        for column in order:
            if spans and spans[-1][0] + spans[-1][1] == column:
                spans[-1][1] += 1
            else:
                spans.append([column, 1])
        only = next(iter(self._shardings.values())) if len(self._shardings) == 1 else None
        if only is not None and getattr(only, "take_column_order", lambda _: False)(spans):
            return None
        return check_blocks(cut_at_chunks(spans, [len(order)]), [len(order)])

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        pending = [s.output_dist(local, sharding_ctx) for s, sharding_ctx, local
                   in zip(self._shardings.values(), ctx.sharding_contexts, output)]
        return _KeyedTensorAwaitable(pending, self)

    def embedding_bag_configs(self):  # noqa: ANN201 - mirrors the unsharded module
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

