"""Shard geometry: how a table's rows and columns are cut for each sharding type.

Plain arithmetic on metadata (no torch.distributed), shared by manual plans, the planner and
the sharded modules so that all three agree on every offset.

- table-wise: one shard, the whole table, on one rank.
- row-wise: `block = ceil(rows / n)` rows per rank; the last ranks may get fewer or none
  (10 rows / 4 ranks -> 3, 3, 3, 1; 3 rows / 4 ranks -> 1, 1, 1, 0).
- table-row-wise: row-wise over the ranks of one node.
- column-wise / table-column-wise: `cols` split into `len(ranks)` shards as evenly as possible,
  the first `cols % n` shards one column wider (10 cols / 4 -> 3, 3, 2, 2). Any dim works.
- data-parallel: no shards, every rank holds the whole table.
"""

from __future__ import annotations

from typing import List, Sequence

from recshard.plan.sharding_types import ROW_SPLIT_TYPES
from recshard.types import ShardingType, ShardMetadata


def row_block_size(rows: int, num_shards: int) -> int:
    """Rows per row-wise shard (the last shards may be shorter)."""
    return max(1, -(-rows // num_shards))


def row_wise_sizes(rows: int, num_shards: int) -> List[int]:
    """Rows held by each of `num_shards` ranks under row-wise sharding."""
    block = row_block_size(rows, num_shards)
    return [max(0, min(block, rows - i * block)) for i in range(num_shards)]


def column_wise_sizes(cols: int, num_shards: int) -> List[int]:
    """Columns of each column shard; widths differ by at most one."""
    if num_shards > cols:
        raise ValueError(f"cannot split {cols} columns into {num_shards} column shards")
    base, extra = divmod(cols, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def _placement(rank: int, device_type: str) -> str:
    return f"rank:{rank}/{device_type}"


def make_shards(
    sharding_type: str,
    rows: int,
    cols: int,
    ranks: Sequence[int],
    device_type: str = "cpu",
) -> List[ShardMetadata] | None:
    """The shards of a `rows x cols` table placed on `ranks` (one shard per listed rank).

    Row-wise types list every rank that holds rows, in row order; column-wise types list one
    rank per column shard, in column order (a rank may appear twice).
    """
    st = ShardingType(sharding_type)
    if st == ShardingType.DATA_PARALLEL:
        return None
    if st == ShardingType.TABLE_WISE:
        if len(ranks) != 1:
            raise ValueError(f"table-wise sharding takes one rank, got {list(ranks)}")
        return [ShardMetadata([0, 0], [rows, cols], _placement(ranks[0], device_type))]
    if st in ROW_SPLIT_TYPES:  # table-wise was handled above
        sizes = row_wise_sizes(rows, len(ranks))
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return [
            ShardMetadata([off, 0], [size, cols], _placement(rank, device_type))
            for rank, off, size in zip(ranks, offsets, sizes)
        ]
    widths = column_wise_sizes(cols, len(ranks))
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    return [
        ShardMetadata([0, off], [rows, width], _placement(rank, device_type))
        for rank, off, width in zip(ranks, offsets, widths)
    ]
