"""Which sharding types go together, written once: what each collection supports, which
types cut rows and which cut columns, which share one placed sharding, and which compute
kernels a float sharder offers for each."""

from __future__ import annotations

from typing import FrozenSet, List

from recshard.types import EmbeddingComputeKernel, ShardingType

ALL_SHARDING_TYPES: FrozenSet[ShardingType] = frozenset(ShardingType)
# EmbeddingCollection (sequence outputs): no table-row-wise or table-column-wise
SEQUENCE_SHARDING_TYPES: FrozenSet[ShardingType] = frozenset(
    {
        ShardingType.DATA_PARALLEL,
        ShardingType.TABLE_WISE,
        ShardingType.COLUMN_WISE,
        ShardingType.ROW_WISE,
    }
)
# shards cut the rows (every shard spans all columns) / the columns (all rows)
ROW_SPLIT_TYPES: FrozenSet[ShardingType] = frozenset(
    {
        ShardingType.TABLE_WISE,
        ShardingType.ROW_WISE,
        ShardingType.TABLE_ROW_WISE,
    }
)
COLUMN_SPLIT_TYPES: FrozenSet[ShardingType] = frozenset(
    {
        ShardingType.COLUMN_WISE,
        ShardingType.TABLE_COLUMN_WISE,
    }
)
# a table's rows cut in blocks over several ranks: ids bucketized by block, partial pools summed
ROW_BLOCK_TYPES: FrozenSet[ShardingType] = frozenset(
    {
        ShardingType.ROW_WISE,
        ShardingType.TABLE_ROW_WISE,
    }
)
# shards confined to one node of `local_world_size` ranks
WITHIN_NODE_TYPES: FrozenSet[ShardingType] = frozenset(
    {
        ShardingType.TABLE_ROW_WISE,
        ShardingType.TABLE_COLUMN_WISE,
    }
)
# whole tables or column blocks placed on ranks: one KJT all-to-all and one output all-to-all
# serve all of them (`recshard/sharding/placed.py`, `sequence.py`)
PLACED_TYPES: FrozenSet[ShardingType] = frozenset({ShardingType.TABLE_WISE}) | COLUMN_SPLIT_TYPES


def sharding_type_values(types: FrozenSet[ShardingType]) -> List[str]:
    """The string values of `types`, in `ShardingType`'s order."""
    return [t.value for t in ShardingType if t in types]


def supported_compute_kernels(sharding_type: str, compute_device_type: str) -> List[str]:
    """The compute kernels a float sharder offers for one sharding type on one device type."""
    if ShardingType(sharding_type) == ShardingType.DATA_PARALLEL:
        return [EmbeddingComputeKernel.DENSE.value]
    kernels = [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]
    if compute_device_type == "cuda":
        kernels += [
            EmbeddingComputeKernel.FUSED_UVM.value,
            EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
        ]
    return kernels


def opt_in_compute_kernels(sharding_type: str, compute_device_type: str) -> List[str]:
    """Kernels a float sharder runs when a plan names them but never offers for a planner to
    choose on its own (as TorchRec's planner takes `key_value` only from constraints):
    `key_value` on CPU, for every type but data-parallel."""
    if ShardingType(sharding_type) == ShardingType.DATA_PARALLEL or compute_device_type != "cpu":
        return []
    return [EmbeddingComputeKernel.KEY_VALUE.value]
