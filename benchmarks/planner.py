"""Planner benchmark: plan time and estimated balance on random table sets (fixed seed).

    python benchmarks/planner.py                 # 100/500/1000 tables x 8/64/128 ranks
    python benchmarks/planner.py --large         # also 50,000 x 8 and 10,000 x 1,024
    python benchmarks/planner.py --tables 1000 --ranks 128 --device cpu

Tables: rows log-uniform in [1e3, 1e7], dims 32..256 (multiples of 8), one feature with a
pooling factor uniform in [1, 20], row-wise Adagrad. Topology: 8 ranks per host, defaults of
`Topology` for the device (cuda: 32 GiB HBM, 128 GiB DDR per rank). One JSON line per case:
plan_s (wall time of `plan_tables`), imbalance (max/mean estimated rank time), max_ms,
mean_ms, bound_ratio (max rank time over a lower bound: least total work / ranks, ignoring
memory), proposals, and the chosen sharding types and kernels.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from typing import List

from recshard.planner import EmbeddingEnumerator, EmbeddingShardingPlanner, TableMeta, Topology


def make_tables(n: int, seed: int = 0) -> List[TableMeta]:
    rng = random.Random(seed)
    return [
        TableMeta(f"t{i}", int(10 ** rng.uniform(3, 7)), rng.choice(range(32, 257, 8)),
                  pooling_factors=[round(rng.uniform(1, 20), 2)],
                  optimizer="exact_row_wise_adagrad")
        for i in range(n)
    ]


def lower_bound(tables: List[TableMeta], topology: Topology, batch_size: int) -> float:
    space = EmbeddingEnumerator(topology, batch_size).enumerate_tables(tables)
    return sum(min(o.total_perf for o in options) for options in space) / topology.world_size


def run_case(n: int, world: int, device: str, batch_size: int, seed: int, bound: bool) -> dict:
    tables = make_tables(n, seed)
    topology = Topology(world, device, local_world_size=min(8, world))
    planner = EmbeddingShardingPlanner(topology, batch_size=batch_size, debug=False)
    start = time.perf_counter()
    planner.plan_tables(tables)
    elapsed = time.perf_counter() - start
    stats = planner.last_stats
    assert stats is not None
    row = {
        "bench": "planner", "tables": n, "ranks": world, "local_world_size": min(8, world),
        "device": device, "batch_size": batch_size, "seed": seed,
        "plan_s": round(elapsed, 3), "imbalance": round(stats.imbalance, 4),
        "max_ms": round(stats.max_time, 3), "mean_ms": round(stats.mean_time, 3),
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
    p.add_argument("--large", action="store_true",
                   help="also run 50,000 tables x 8 ranks and 10,000 tables x 1,024 ranks")
    p.add_argument("--no-bound", action="store_true", help="skip the lower-bound computation")
    args = p.parse_args()
    cases = [(n, w) for n in args.tables for w in args.ranks]
    if args.large:
        cases += [(50_000, 8), (10_000, 1024)]
    for n, w in cases:
        print(json.dumps(run_case(n, w, args.device, args.batch_size, args.seed,
                                  not args.no_bound)), flush=True)


if __name__ == "__main__":
    main()
