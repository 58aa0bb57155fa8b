"""A sharded collection's tables as state: this rank's shards, their live weights, fused
optimizer state and row scale/bias, read from its shardings; unsharded tables copied in.

What `ShardedEmbeddingModule` answers for the `ShardedTableState` protocol
(`sharded_state.py`: state dicts and checkpoints) and for its unsharded names
(`unsharded_names.py`).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from recshard.lookup.tables import LocalTable
from recshard.sharding.common import EmbeddingSharding

Shards = Dict[str, List[Tuple[LocalTable, torch.Tensor]]]


def local_table_shards(shardings: Iterable[EmbeddingSharding]) -> Shards:
    """Per table name, this rank's shards and their live weights (views)."""
    out: Shards = {}
    for sharding in shardings:
        for table, weight in sharding.local_shards():
            out.setdefault(table.name, []).append((table, weight))
    return out


def fused_optimizer_states(
    shardings: Iterable[EmbeddingSharding],
) -> Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]]:
    """Per table name, this rank's shards and their fused optimizer state (views)."""
    out: Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]] = {}
    for sharding in shardings:
        for kernel in sharding.lookup.kernels:
            if kernel.is_fused:
                for table, states in zip(kernel.tables, kernel.optimizer_states()):
                    out.setdefault(table.name, []).append((table, states))
    return out


def local_scale_bias(shardings: Iterable[EmbeddingSharding]) -> Shards:
    """Per quantized integer table, this rank's shards and their row scale/bias
    (`fp16 [rows, 2]`, views); empty for float tables."""
    out: Shards = {}
    for sharding in shardings:
        scale_bias = getattr(sharding.lookup, "table_scale_bias", None)
        if scale_bias is None:
            continue
        for table, rows in zip(sharding.lookup.tables, scale_bias()):
            if rows is not None:
                out.setdefault(table.name, []).append((table, rows))
    return out


def load_full_tables(shards: Shards, full: Dict[str, torch.Tensor]) -> None:
    """Copy each shard's slice out of full (unsharded) table tensors."""
    with torch.no_grad():
        for name, table_shards in shards.items():
            if name not in full:
                continue
            tensor = full[name]
            for table, weight in table_shards:
                block = tensor[
                    table.row_offset : table.row_offset + table.rows,
                    table.col_offset : table.col_offset + table.cols,
                ]
                if tuple(block.shape) != tuple(weight.shape):
                    raise ValueError(
                        f"table '{name}': shard needs a {tuple(weight.shape)} block, "
                        f"the source tensor of shape {tuple(tensor.shape)} "
                        f"gives {tuple(block.shape)}"
                    )
                weight.copy_(block)


def shard_fqn(key: str, table: LocalTable, shards_on_rank: int) -> str:
    """The table's key (`embedding_bags.<table>.weight`), plus `@col<offset>` when this rank
    holds several column shards of the table."""
    return f"{key}@col{table.col_offset}" if shards_on_rank > 1 else key
