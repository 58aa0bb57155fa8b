"""What sharded pooled collections (float and quantized) share on the output side: one
column permutation from the shardings' concatenated outputs to the module's key order."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

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
        if module._column_order is not None:
            values = values.index_select(1, module._column_order.to(values.device))
        return KeyedTensor(module._feature_names, module._feature_dims, values)


class PooledOutputMixin:
    """Needs `_shardings`, `_feature_names`, `_feature_dims`, `_configs`, `_is_weighted`;
    set `_column_order = self._output_permutation()` once the shardings exist."""

    def _output_permutation(self) -> Optional[torch.Tensor]:
        """Index mapping concatenated sharding columns to the module's feature order."""
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
        return torch.tensor(order, dtype=torch.long)

    def output_dist(self, ctx: Dict[str, Any], output: List[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        pending = [s.output_dist(local, ctx) for s, local in zip(self._shardings.values(), output)]
        return _KeyedTensorAwaitable(pending, self)

    def embedding_bag_configs(self):  # noqa: ANN201 - mirrors the unsharded module
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

