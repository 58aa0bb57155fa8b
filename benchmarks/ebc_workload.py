"""The sharded-EBC benchmark's workload in plain torch: table sizes, pooling factors, batches,
table-wise placements and the memory-bandwidth floor.

Plain torch on purpose: `benchmarks/torchrec_ebc.py.txt` (run by a TorchRec venv's python)
imports this module too, so both libraries train on the very same tables and ids.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import List, Tuple

import torch

# Distinct values per categorical column of the Criteo Kaggle data (26 sparse features).
CRITEO_KAGGLE_ROWS = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]
LEARNING_RATE = 0.01
# A step reads each looked-up row in forward, then reads and writes it in the fused update.
ROW_PASSES = 3


@dataclass(frozen=True)
class Sizes:
    """Problem sizes: the sharded step, then the single-process kernel comparison."""

    row_cap: int = 200_000
    dim: int = 64
    batch: int = 2048  # per rank
    max_pooling: int = 20
    kernel_tables: int = 8
    kernel_rows: int = 100_000
    kernel_batch: int = 2048
    kernel_pooling: int = 20


QUICK = Sizes(
    row_cap=1000,
    dim=16,
    batch=64,
    max_pooling=4,
    kernel_tables=2,
    kernel_rows=1000,
    kernel_batch=64,
    kernel_pooling=4,
)


def table_rows(sizes: Sizes) -> List[int]:
    """Rows of table `t<i>` (read by feature `cat_<i>`), capped at `sizes.row_cap`."""
    return [min(rows, sizes.row_cap) for rows in CRITEO_KAGGLE_ROWS]


def pooling_factors(num_tables: int, max_pooling: int) -> List[int]:
    """Ids per bag of each table, fixed (seed 0): the same on every rank and every step."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, max_pooling + 1, (num_tables,), generator=g).tolist()


def batch_tensors(
    rows: List[int], pooling: List[int], batch: int, seed: int, count: int
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """`count` (values, lengths) pairs of `batch` samples, feature-major: table t's bags hold
    `pooling[t]` uniform ids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(pooling, dtype=torch.int32).repeat_interleave(batch)
    return [
        (
            torch.cat(
                [torch.randint(0, n, (p * batch,), generator=g) for n, p in zip(rows, pooling)]
            ),
            lengths,
        )
        for _ in range(count)
    ]


def balanced_ranks(pooling: List[int], world_size: int) -> List[int]:
    """Table-wise placement: heaviest tables first, each onto the rank with fewest lookups."""
    load = [0] * world_size
    ranks = [0] * len(pooling)
    for t in sorted(range(len(pooling)), key=lambda t: -pooling[t]):
        rank = min(range(world_size), key=lambda r: load[r])
        ranks[t] = rank
        load[rank] += pooling[t]
    return ranks


def contiguous_ranks(pooling: List[int], world_size: int) -> List[int]:
    """Table-wise placement in table order: rank r takes the r-th run of tables, runs cut
    where the running lookup count crosses r / world_size of the total."""
    total, running, ranks = sum(pooling), 0, []
    for p in pooling:
        ranks.append(min(world_size - 1, int(world_size * (running + p / 2) / total)))
        running += p
    return ranks


def copy_bandwidth_gbs(megabytes: int = 256, repeats: int = 5) -> float:
    """Sequential copy bandwidth of this thread, GB/s of bytes read plus bytes written
    (median of `repeats` copies of `megabytes`)."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def floor_ms(sizes: Sizes, pooling: List[int], cores: int, bandwidth_gbs: float) -> float:
    """The step's memory-bandwidth floor: every looked-up row of one rank-batch read in
    forward and read + written in the update, spread over `cores`, at `bandwidth_gbs` per core."""
    row_bytes = sizes.dim * 4
    total = sum(pooling) * sizes.batch * row_bytes * ROW_PASSES
    return 1e3 * total / cores / (bandwidth_gbs * 1e9)
