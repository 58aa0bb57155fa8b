"""Planner benchmark: plan time and estimated balance on random table sets (fixed seed).

    python benchmarks/planner.py                 # 100/500/1000 tables x 8/64/128 ranks
    python benchmarks/planner.py --large         # also 50,000 x 8 and 10,000 x 1,024
    python benchmarks/planner.py --large --tables --ranks   # only the two large cases
    python benchmarks/planner.py --tables 1000 --ranks 128 --device cpu

Tables: rows log-uniform in [1e3, 1e7], dims 32..256 (multiples of 8), one feature with a
pooling factor uniform in [1, 20], row-wise Adagrad. Topology: 8 ranks per host, defaults of
`Topology` for the device (cuda: 32 GiB HBM, 128 GiB DDR per rank). One JSON line per case:
plan_s (wall time of `plan_tables`), plan_cpu_s (its process CPU time: less skewed by other
load), load_avg_1m (the machine's 1-minute load average after the case), imbalance (max/mean
estimated rank time), max_ms, mean_ms, bound_ratio (max rank time over a lower bound: least total
work / ranks, ignoring memory), proposals, and the chosen sharding types and kernels.

The large cases must fit to be planned at all: 50,000 tables of up to 1e7 rows are ~31 TB,
and every table, even on UVM, keeps a few MiB of HBM at batch 512 (~250 GiB for 50,000), so
50,000 x 8 uses rows in [1e3, 1e4] on 80 GiB HBM per rank; 10,000 x 1,024 uses the default
tables and topology.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter
from typing import List, Tuple

from recshard.planner import EmbeddingEnumerator, EmbeddingShardingPlanner, TableMeta, Topology
from recshard.planner.planner_types import GIB


def make_tables(n: int, seed: int = 0, max_rows_log10: float = 7.0) -> List[TableMeta]:
    rng = random.Random(seed)
    return [
        TableMeta(
            f"t{i}",
            int(10 ** rng.uniform(3, max_rows_log10)),
            rng.choice(range(32, 257, 8)),
            pooling_factors=[round(rng.uniform(1, 20), 2)],
            optimizer="exact_row_wise_adagrad",
        )
        for i in range(n)
    ]


def lower_bound(tables: List[TableMeta], topology: Topology, batch_size: int) -> float:
    space = EmbeddingEnumerator(topology, batch_size).enumerate_tables(tables)
    return sum(min(o.total_perf for o in options) for options in space) / topology.world_size


def run_case(
    n: int,
    world: int,
    device: str,
    batch_size: int,
    seed: int,
    bound: bool,
    max_rows_log10: float = 7.0,
    hbm_gb: float | None = None,
) -> dict:
    tables = make_tables(n, seed, max_rows_log10)
    hbm = None if hbm_gb is None or device == "cpu" else hbm_gb * GIB
    topology = Topology(world, device, local_world_size=min(8, world), hbm_cap=hbm)
    planner = EmbeddingShardingPlanner(topology, batch_size=batch_size, debug=False)
    start, cpu_start = time.perf_counter(), time.process_time()
    planner.plan_tables(tables)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stats = planner.last_stats
    assert stats is not None
    row = {
        "bench": "planner",
        "tables": n,
        "ranks": world,
        "local_world_size": min(8, world),
        "device": device,
        "batch_size": batch_size,
        "seed": seed,
        "max_rows": int(10**max_rows_log10),
        "hbm_gib": topology.hbm_cap / GIB,
        "plan_s": round(elapsed, 3),
        "plan_cpu_s": round(cpu, 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "imbalance": round(stats.imbalance, 4),
        "max_ms": round(stats.max_time, 3),
        "mean_ms": round(stats.mean_time, 3),
        "proposals": stats.num_proposals,
        "types": dict(Counter(t.sharding_type for t in stats.tables)),
        "kernels": dict(Counter(t.compute_kernel for t in stats.tables)),
    }
    if bound:
        row["bound_ratio"] = round(stats.max_time / lower_bound(tables, topology, batch_size), 4)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, nargs="*", default=[100, 500, 1000])
    p.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 128])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--large",
        action="store_true",
        help="also run 50,000 tables x 8 ranks and 10,000 tables x 1,024 ranks",
    )
    p.add_argument("--no-bound", action="store_true", help="skip the lower-bound computation")
    args = p.parse_args()
    # (tables, ranks, log10 of the most rows, HBM GiB per rank or None for the default)
    cases: List[Tuple[int, int, float, float | None]] = [
        (n, w, 7.0, None) for n in args.tables for w in args.ranks
    ]
    if args.large:
        cases += [(50_000, 8, 4.0, 80.0), (10_000, 1024, 7.0, None)]
    for n, w, max_rows_log10, hbm_gb in cases:
        print(
            json.dumps(
                run_case(
                    n,
                    w,
                    args.device,
                    args.batch_size,
                    args.seed,
                    not args.no_bound,
                    max_rows_log10,
                    hbm_gb,
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
