"""recshard's sharded step with its all-to-alls between the ranks of one host through gloo's
loopback TCP (`RECSHARD_SHM_ALL_TO_ALL=0`) and through shared memory (`recshard.comm.shm`,
the default), interleaved.

    python -m benchmarks.shm_exchange                          # column_wise,table_wise, 3 repeats
    python -m benchmarks.shm_exchange --cases column_wise --repeats 5
    python -m benchmarks.shm_exchange --quick                  # tiny sizes (smoke test)

The workload of `benchmarks/ebc.py` (2 pinned ranks, one torch thread each, 3 warm-up + 30
timed steps, a run's figure the median of the slowest rank's steps). Each case runs twice per
repeat: gloo, then shared memory. Every flat all-to-all that
`recshard.comm.request.issue_all_to_all` carries (the KJT ids + lengths, the pooled embeddings
forward and backward) changes transport; the splits exchange stays on gloo. Both runs report a
checksum of the rank's table weights after the timed steps: the values must be equal (the
same bytes arrive either way). Every line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List

import torch.distributed as dist

from benchmarks.ebc import build, criteo_tables, make_batches, train_step
from benchmarks.ebc_workload import QUICK, Sizes, pooling_factors
from benchmarks.ranks import run_ranks, timed_steps, warm_up
from recshard.comm.shm import ENV


def run(name: str, sizes: Sizes, args: argparse.Namespace, shm: bool) -> Dict[str, object]:
    """One run on this rank: step seconds and a checksum of its table weights afterwards."""
    os.environ[ENV] = "1" if shm else "0"  # read at the group's first all-to-all
    rank = dist.get_rank()
    tables = criteo_tables(sizes)
    pooling = pooling_factors(len(tables), sizes.max_pooling)
    batches = make_batches(tables, pooling, sizes.batch, seed=1 + rank, count=args.batches)
    trainee = build(name, tables, pooling, sizes.batch, None)
    warm_up(lambda i: train_step(trainee, batches[i % len(batches)]), args.warmup)
    times = timed_steps(lambda i: train_step(trainee, batches[i % len(batches)]), args.steps)
    checksum = sum(
        float(w.double().sum())
        for sharding in trainee.module.shardings.values()
        for w in sharding.lookup.table_weights()
    )
    return {"times": times, "checksum": checksum}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="column_wise,table_wise")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 steps, 1 repeat")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 3, 1
    rank_args = argparse.Namespace(threads=1, pin=True, timeout=600.0)
    figures: Dict[str, Dict[bool, List[float]]] = {}
    for _ in range(args.repeats):
        for case in args.cases.split(","):
            sums = {}
            for shm in (False, True):
                ranks = run_ranks(2, rank_args, run, case, sizes, args, shm)
                step = statistics.median(max(s) for s in zip(*(r["times"] for r in ranks)))
                figures.setdefault(case, {}).setdefault(shm, []).append(step)
                sums[shm] = [r["checksum"] for r in ranks]
            print(
                json.dumps(
                    dict(
                        bench="shm_exchange_run",
                        case=case,
                        gloo_ms=round(1e3 * figures[case][False][-1], 2),
                        shm_ms=round(1e3 * figures[case][True][-1], 2),
                        same_weights=sums[False] == sums[True],
                    )
                ),
                flush=True,
            )
    for case, by_mode in figures.items():
        gloo, shm = statistics.median(by_mode[False]), statistics.median(by_mode[True])
        print(
            json.dumps(
                dict(
                    bench="shm_exchange",
                    case=case,
                    gloo_step_ms=round(1e3 * gloo, 2),
                    shm_step_ms=round(1e3 * shm, 2),
                    saved_pct=round(100 * (1 - shm / gloo), 1),
                    gloo_repeats_ms=[round(1e3 * m, 2) for m in by_mode[False]],
                    shm_repeats_ms=[round(1e3 * m, 2) for m in by_mode[True]],
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
