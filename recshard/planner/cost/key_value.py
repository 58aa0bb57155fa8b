"""What a `key_value` shard costs (cpu): its rows and optimizer state in files on local
storage, a DRAM cache of `load_factor` of its rows (TorchRec's `CacheParams.load_factor`,
default 0.2), each step's misses read from storage and its updated rows written back.

- DRAM: `ceil(lf rows) (row_bytes + state_row + 16)` for the cached rows with their state and
  the slot maps, 4 bytes per row for the row -> slot map, `4 min(touched, ceil(lf rows))
  (row_bytes + state_row)` for a step's transient copies of its distinct rows (misses read,
  victims written back, gradients, optimizer temporaries), plus the step's io
  (`recshard.lookup.key_value.dram_bytes`, which the tests compare this to); a row-wise state
  (per row only) is also mapped whole (the cache copies it to and from the mapping): its
  bytes count in DRAM once more; storage: weights + state.
- time on top of the fused kernel's on the cache: `(1 - hit) touched (row + state_row)` bytes
  read and `touched (row + state_row)` bytes written at `topology.storage_bw`, `touched` the
  shard's distinct rows per step (`touched_rows`, from `CacheStatistics.expected_lookups` when
  given), `hit` the expected hit rate (`cache_hit_rate`: `1 - CacheStatistics.
  expected_miss_rate(load_factor)` when given).
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

from recshard.planner.cost.cache_stats import cache_hit_rate, cache_load_factor, touched_rows
from recshard.planner.placement import PartitionResult
from recshard.planner.planner_types import (
    GIB,
    PlannerError,
    ShardingOption,
    Storage,
    TableMeta,
    Topology,
)
from recshard.types import CacheParams

KEY_VALUE = "key_value"
_SLOT_BYTES = 16  # per cached row: its row id (int64), pin count (int32) and four flags
_ROW_MAP_BYTES = 4  # per row of the shard: its cache slot (int32)
_STEP_ROW_COPIES = 4  # a step's transient copies of its distinct rows with their state


def offers_key_value(
    topology: Topology, sharding_type: str, kernels: Sequence[str], named: bool
) -> bool:
    """Whether a shard of this type may be planned `key_value`: on cpu, a model-parallel type
    whose sharder runs the fused kernel (it runs `key_value` too), when the topology has
    storage for it or the constraints name it (`named`; its storage is checked then)."""
    return (
        topology.compute_device == "cpu"
        and sharding_type != "data_parallel"
        and "fused" in kernels
        and (named or topology.storage_cap > 0)
    )


def drop_over_storage(
    space: List[List[ShardingOption]], topology: Topology
) -> List[List[ShardingOption]]:
    """Options whose largest shard's files fit one rank's `storage_cap`; PlannerError naming
    a table left with none."""
    kept = [[o for o in options if o.max_storage <= topology.storage_cap] for options in space]
    for options, left in zip(space, kept):
        if not left:
            need = min(o.max_storage for o in options)
            raise PlannerError(
                f"table '{options[0].table.key}': its only options are key_value, whose "
                f"smallest shard keeps {need / GIB:.3f} GiB on local storage, and a rank has "
                f"{topology.storage_cap / GIB:.3f} GiB (storage_cap)"
            )
    return kept


def key_value_storage(
    rows: int,
    weights: float,
    state: float,
    io: float,
    cache_params: CacheParams | None,
    touched: float,
    row_state: float,
) -> Storage:
    """DRAM and storage bytes of a `rows`-row shard whose steps read `touched` distinct rows,
    `row_state` of its `state` bytes a row-wise state (mapped whole and cached; module
    docstring)."""
    per_row = (weights + state) / rows if rows else 0.0
    cached = min(rows, math.ceil(cache_load_factor(cache_params) * rows))
    transient = _STEP_ROW_COPIES * min(touched, cached) * per_row
    dram = cached * (per_row + _SLOT_BYTES) + rows * _ROW_MAP_BYTES + row_state + transient + io
    return Storage(0.0, dram, weights + state)


def key_value_io_ms(
    table: TableMeta,
    cache_params: CacheParams | None,
    rows: int,
    ids_in: float,
    global_ids: float,
    row_bytes: float,
    topology: Topology,
) -> Tuple[float, float]:
    """(forward, backward) ms a step spends on storage: misses read, updated rows written;
    `row_bytes` a row with its optimizer state."""
    if rows == 0:
        return 0.0, 0.0
    touched = touched_rows(table, cache_params, rows, ids_in, global_ids)
    hit = cache_hit_rate(cache_params, rows)
    moved = touched * row_bytes / topology.storage_bw
    return (1.0 - hit) * moved, moved


def storage_per_rank(result: PartitionResult, world_size: int) -> List[float]:
    """Bytes of `key_value` files each rank keeps under a placement."""
    used = [0.0] * world_size
    for option, ranks in zip(result.proposal, result.ranks):
        if ranks is not None and option.compute_kernel == KEY_VALUE:
            for shard, rank in zip(option.shards, ranks):
                used[rank] += shard.storage.storage
    return used


def storage_fits(result: PartitionResult, topology: Topology) -> bool:
    return max(storage_per_rank(result, topology.world_size)) <= topology.storage_cap


def check_storage_fits(result: PartitionResult, topology: Topology) -> None:
    """PlannerError if a placement puts more `key_value` files on a rank than its
    `storage_cap`, naming the rank, the bytes and its tables."""
    used = storage_per_rank(result, topology.world_size)
    over = [r for r, u in enumerate(used) if u > topology.storage_cap]
    if over:
        r = over[0]
        names = sorted(
            {
                o.table.key
                for o, ranks in zip(result.proposal, result.ranks)
                if o.compute_kernel == KEY_VALUE and ranks and r in ranks
            }
        )
        raise PlannerError(
            f"no sharding plan fits: rank {r} would keep {used[r] / GIB:.3f} GiB of key_value "
            f"tables ({', '.join(names)}) on local storage, which holds "
            f"{topology.storage_cap / GIB:.3f} GiB (storage_cap); give more storage, more ranks "
            "or more DRAM (ddr_cap)"
        )
