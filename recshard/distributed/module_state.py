"""Table state shared by sharded collections: start from the unsharded weights, list shards.

If the unsharded module already has real weights (not `meta`), the shards start from them —
TorchRec re-initializes CPU modules silently; recshard keeps what the user built.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from recshard.lookup.tables import LocalTable
from recshard.optim.fused import FusedOptimizer


class ShardedTablesMixin:
    """Needs `self._shardings: Dict[str, EmbeddingSharding]`."""

    _tables_attr = "embedding_bags"

    def local_table_shards(self) -> Dict[str, List[Tuple[LocalTable, torch.Tensor]]]:
        """Per table name, this rank's shards and their live weights (views)."""
        out: Dict[str, List[Tuple[LocalTable, torch.Tensor]]] = {}
        for sharding in self._shardings.values():
            for table, weight in sharding.local_shards():
                out.setdefault(table.name, []).append((table, weight))
        return out

    def load_full_tables(self, full: Dict[str, torch.Tensor]) -> None:
        """Copy each rank's slice out of full (unsharded) table tensors."""
        with torch.no_grad():
            for name, shards in self.local_table_shards().items():
                if name not in full:
                    continue
                tensor = full[name]
                for table, weight in shards:
                    block = tensor[table.row_offset:table.row_offset + table.rows,
                                   table.col_offset:table.col_offset + table.cols]
                    if tuple(block.shape) != tuple(weight.shape):
                        raise ValueError(
                            f"table '{name}': shard needs a {tuple(weight.shape)} block, the source "
                            f"tensor of shape {tuple(tensor.shape)} gives {tuple(block.shape)}"
                        )
                    weight.copy_(block)

    def _init_from(self, module: nn.Module) -> None:
        tables = getattr(module, self._tables_attr)
        full = {name: m.weight for name, m in tables.items() if m.weight.device.type != "meta"}
        self.load_full_tables(full)
        for sharding in self._shardings.values():
            sharding.after_init()

    def shard_fqn(self, table: LocalTable, shards_on_rank: int) -> str:
        """`embedding_bags.<table>.weight`, plus `@col<offset>` when this rank holds several
        column shards of the table."""
        name = f"{self._tables_attr}.{table.name}.weight"
        return f"{name}@col{table.col_offset}" if shards_on_rank > 1 else name

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The in-backward optimizer of this module's fused tables (keyed by table FQN)."""
        counts = {name: len(shards) for name, shards in self.local_table_shards().items()}
        kernels, names = [], []
        for sharding in self._shardings.values():
            for kernel in sharding.lookup.kernels:
                if kernel.is_fused:
                    kernels.append(kernel)
                    names.append([self.shard_fqn(t, counts[t.name]) for t in kernel.tables])
        return FusedOptimizer(kernels, names)
