"""Planner statistics as data (`PlannerStats`) and as the text tables the planner logs; for
any plan (not only the planner's), `plan_stats` (from `recshard.planner.cost.plan_stats`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Dict, List, Sequence

from recshard.planner.cost.key_value import storage_per_rank
from recshard.planner.cost.plan_stats import PlanStats, RankLoad, plan_stats
from recshard.planner.cost.reservation import Capacity
from recshard.planner.placement import PartitionResult
from recshard.planner.planner_types import GIB, Topology

logger = logging.getLogger(__name__)
__all__ = [
    "EmbeddingStats",
    "PlanStats",
    "PlannerStats",
    "RankLoad",
    "RankStats",
    "TableStats",
    "build_stats",
    "compress_ranks",
    "format_stats",
    "plan_stats",
]

_ABBREV = {
    "data_parallel": "DP",
    "table_wise": "TW",
    "row_wise": "RW",
    "column_wise": "CW",
    "table_row_wise": "TWRW",
    "table_column_wise": "TWCW",
}
_PERF_PARTS = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist")


@dataclass
class RankStats:
    """One rank: memory used and available for tables (bytes), estimated time (ms), shards."""

    rank: int
    hbm: float
    hbm_cap: float
    ddr: float
    ddr_cap: float
    fwd_compute: float
    fwd_comms: float
    bwd_compute: float
    bwd_comms: float
    input_dist: float
    total: float
    num_shards: int
    sharding_types: Dict[str, int]
    storage: float = 0.0  # key_value tables' files on local storage
    storage_cap: float = 0.0


@dataclass
class TableStats:
    """One table: how it is sharded, where, its slowest shard (ms) and its memory (bytes)."""

    module_fqn: str
    name: str
    sharding_type: str
    compute_kernel: str
    ranks: List[int]
    num_shards: int
    max_shard_perf: float
    hbm: float
    ddr: float
    storage: float = 0.0  # key_value: its files on local storage (DRAM: `ddr`)


@dataclass
class PlannerStats:
    """What the planner found: per-rank and per-table tables, imbalance, search effort."""

    world_size: int
    local_world_size: int
    compute_device: str
    batch_size: int
    num_proposals: int
    num_feasible: int
    plan_time_s: float
    reserved_dense_bytes: float
    reserved_kjt_bytes: float
    reserved_fraction: float
    reserved_transport_bytes: float = 0.0
    ranks: List[RankStats] = field(default_factory=list)
    tables: List[TableStats] = field(default_factory=list)

    @property
    def max_time(self) -> float:
        return max(r.total for r in self.ranks)

    @property
    def mean_time(self) -> float:
        return sum(r.total for r in self.ranks) / len(self.ranks)

    @property
    def imbalance(self) -> float:
        """Slowest rank's estimated time over the mean (1.0 = perfectly balanced)."""
        mean = self.mean_time
        return self.max_time / mean if mean > 0 else 1.0

    @property
    def memory_imbalance(self) -> float:
        used = [r.hbm if self.compute_device == "cuda" else r.ddr for r in self.ranks]
        mean = sum(used) / len(used)
        return max(used) / mean if mean > 0 else 1.0

    def format(self, max_rows: int = 0) -> str:
        """The stats as text tables (`max_rows` > 0 truncates the per-table list)."""
        return format_stats(self, max_rows)


def compress_ranks(ranks: Sequence[int]) -> str:
    """ "0-3,6,8-9" for [0,1,2,3,6,8,9] (order kept, runs collapsed)."""
    parts: List[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def build_stats(
    result: PartitionResult,
    capacity: Capacity,
    topology: Topology,
    batch_size: int,
    num_proposals: int,
    num_feasible: int,
    plan_time_s: float,
) -> PlannerStats:
    """Per-rank and per-table statistics of a feasible placement."""
    world = topology.world_size
    parts = {name: [0.0] * (world + 1) for name in _PERF_PARTS}
    num_shards = [0] * (world + 1)
    types: List[Dict[str, int]] = [{} for _ in range(world)]
    tables: List[TableStats] = []
    for option, ranks in zip(result.proposal, result.ranks):
        assert ranks is not None
        abbrev = _ABBREV[option.sharding_type]
        if option.partition_by == "uniform":
            start = 0
            for seg in option.segments:
                end = start + seg.count
                for name in _PERF_PARTS:
                    value = getattr(seg.perf, name)
                    parts[name][start] += value
                    parts[name][end] -= value
                start = end
            num_shards[0] += 1
            num_shards[world] -= 1
            for r in range(world):
                types[r][abbrev] = types[r].get(abbrev, 0) + 1
        else:
            r_iter = iter(ranks)
            for seg in option.segments:
                for _ in range(seg.count):
                    r = next(r_iter)
                    for name in _PERF_PARTS:
                        parts[name][r] += getattr(seg.perf, name)
                        parts[name][r + 1] -= getattr(seg.perf, name)
                    num_shards[r] += 1
                    num_shards[r + 1] -= 1
                    types[r][abbrev] = types[r].get(abbrev, 0) + 1
        tables.append(
            TableStats(
                option.module_fqn,
                option.name,
                option.sharding_type,
                option.compute_kernel,
                list(ranks),
                option.num_shards,
                option.max_perf,
                option.total_hbm,
                option.total_ddr,
                sum(seg.count * seg.storage.storage for seg in option.segments),
            )
        )
    sums = {name: list(accumulate(values)) for name, values in parts.items()}
    counts = list(accumulate(num_shards))
    stored = storage_per_rank(result, world)
    stats = PlannerStats(
        world,
        topology.local_world_size,
        topology.compute_device,
        batch_size,
        num_proposals,
        num_feasible,
        plan_time_s,
        capacity.dense_bytes,
        capacity.kjt_bytes,
        capacity.fraction,
        capacity.transport_bytes,
        tables=tables,
    )
    for r in range(world):
        stats.ranks.append(
            RankStats(
                r,
                result.hbm[r],
                capacity.hbm[r],
                result.ddr[r],
                capacity.ddr[r],
                *(sums[name][r] for name in _PERF_PARTS),
                result.perf[r],
                counts[r],
                types[r],
                stored[r],
                topology.storage_cap,
            )
        )
    return stats


def _table(header: List[str], rows: List[List[str]]) -> str:
    widths = [
        max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
        for i, h in enumerate(header)
    ]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    fmt = "| " + " | ".join(f"{{:{'>' if i else '<'}{w}}}" for i, w in enumerate(widths)) + " |"
    out = [line, fmt.format(*header), line]
    out += [fmt.format(*row) for row in rows]
    out.append(line)
    return "\n".join(out)


def _gib(value: float) -> str:
    return f"{value / GIB:.3f}"


def _size(value: float) -> str:
    """Human-readable bytes: GiB, or MiB below 1 GiB."""
    return f"{value / GIB:.3f} GiB" if value >= GIB else f"{value / 2**20:.3f} MiB"


def _pct(used: float, cap: float) -> str:
    return f"{100.0 * used / cap:.1f}%" if cap > 0 else "-"


def format_stats(stats: PlannerStats, max_rows: int = 0) -> str:
    """Text report: summary, per-rank table, per-table table."""
    lines = [
        f"recshard planner: {len(stats.tables)} tables on {stats.world_size} ranks "
        f"({stats.world_size // stats.local_world_size} host(s) x {stats.local_world_size}), "
        f"{stats.compute_device}, batch size {stats.batch_size}",
        f"evaluated {stats.num_proposals} proposals, {stats.num_feasible} fit, "
        f"in {stats.plan_time_s:.3f} s",
        f"estimated step time: max {stats.max_time:.3f} ms, mean {stats.mean_time:.3f} ms, "
        f"imbalance (max/mean) {stats.imbalance:.3f}; memory imbalance "
        f"{stats.memory_imbalance:.3f}",
        f"reserved per rank: dense {_size(stats.reserved_dense_bytes)}, KJT "
        f"{_size(stats.reserved_kjt_bytes)}, "
        + (
            f"intra-host transport {_size(stats.reserved_transport_bytes)}, "
            if stats.reserved_transport_bytes
            else ""
        )
        + f"fraction {stats.reserved_fraction:.0%}",
    ]
    on_storage = any(r.storage or r.storage_cap for r in stats.ranks)
    rank_rows = [
        [
            str(r.rank),
            f"{_gib(r.hbm)} ({_pct(r.hbm, r.hbm_cap)})",
            f"{_gib(r.ddr)} ({_pct(r.ddr, r.ddr_cap)})",
            *([f"{_gib(r.storage)} ({_pct(r.storage, r.storage_cap)})"] if on_storage else []),
            f"{r.total:.3f}",
            f"{r.fwd_compute:.3f}",
            f"{r.fwd_comms:.3f}",
            f"{r.bwd_compute:.3f}",
            f"{r.bwd_comms:.3f}",
            f"{r.input_dist:.3f}",
            str(r.num_shards),
            " ".join(f"{k}:{v}" for k, v in sorted(r.sharding_types.items())),
        ]
        for r in stats.ranks
    ]
    lines.append(
        _table(
            [
                "rank",
                "HBM GiB (%)",
                "DDR GiB (%)",
                *(["storage GiB (%)"] if on_storage else []),
                "time ms",
                "fwd comp",
                "fwd comm",
                "bwd comp",
                "bwd comm",
                "in dist",
                "shards",
                "types",
            ],
            rank_rows,
        )
    )
    shown = stats.tables[:max_rows] if max_rows > 0 else stats.tables
    table_rows = [
        [
            f"{t.module_fqn}.{t.name}" if t.module_fqn else t.name,
            _ABBREV[t.sharding_type],
            t.compute_kernel,
            str(t.num_shards),
            f"{t.max_shard_perf:.3f}",
            _gib(t.hbm),
            _gib(t.ddr),
            *([_gib(t.storage)] if on_storage else []),
            compress_ranks(t.ranks),
        ]
        for t in shown
    ]
    header = ["table", "type", "kernel", "shards", "max shard ms", "HBM GiB", "DDR GiB"]
    lines.append(_table(header + (["storage GiB"] if on_storage else []) + ["ranks"], table_rows))
    if len(shown) < len(stats.tables):
        lines.append(f"... {len(stats.tables) - len(shown)} more tables")
    return "\n".join(lines)


class EmbeddingStats:
    """Logs the planner's statistics at INFO through `logging`."""

    def log(self, stats: PlannerStats) -> None:
        if logger.isEnabledFor(logging.INFO):  # formatting 10k tables is not free
            logger.info("\n%s", stats.format())
