"""What sharded pooled collections (float and quantized) share on the output side: laying
the shardings' outputs out in the module's key order.

The outputs are concatenated, then their column blocks (adjacent columns merged) are permuted
into module order by one `ops.permute_pooled_embs` (fbgemm's block permute, whose backward is
the inverse permute). A per-column `index_select` costs a scatter over every column in
backward, and a `cat` of narrowed views zero-fills a full-size gradient per block. When the
shardings already produce the module's order, nothing is copied.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Tuple

import torch

from recshard import ops
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
        if module._block_permute is not None:
            lists = [t.to(values.device) for t in module._block_permute]
            values = ops.permute_pooled_embs(values, *lists)
        return KeyedTensor(module._feature_names, module._feature_dims, values)


class PooledOutputMixin:
    """Needs `_shardings`, `_feature_names`, `_feature_dims`, `_configs`, `_is_weighted`;
    set `_block_permute = self._output_permute()` once the shardings exist."""

    def _output_permute(self) -> Optional[Tuple[torch.Tensor, ...]]:
        """`permute_pooled_embs` lists taking the concatenated sharding outputs to the module's
        column order (blocks of adjacent columns), or None when they already are in order."""
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
        blocks: List[List[int]] = []  # [input start, width], in output order
        for column in order:
            if blocks and blocks[-1][0] + blocks[-1][1] == column:
                blocks[-1][1] += 1
            else:
                blocks.append([column, 1])
        by_input = sorted(range(len(blocks)), key=lambda i: blocks[i][0])
        input_index = {out: inp for inp, out in enumerate(by_input)}
        permute = [input_index[i] for i in range(len(blocks))]
        inverse = [0] * len(blocks)
        for out_pos, inp in enumerate(permute):
            inverse[inp] = out_pos

        def offsets(widths: List[int]) -> torch.Tensor:
            return torch.tensor([0] + list(itertools.accumulate(widths)), dtype=torch.long)

        return (offsets([blocks[i][1] for i in by_input]), torch.tensor(permute),
                offsets([b[1] for b in blocks]), torch.tensor(inverse))

    def output_dist(self, ctx: Dict[str, Any], output: List[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        pending = [s.output_dist(local, ctx) for s, local in zip(self._shardings.values(), output)]
        return _KeyedTensorAwaitable(pending, self)

    def embedding_bag_configs(self):  # noqa: ANN201 - mirrors the unsharded module
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

