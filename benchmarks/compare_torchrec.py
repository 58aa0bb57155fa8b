"""recshard against TorchRec on the sharded-EBC step, side by side in one run.

    python -m benchmarks.compare_torchrec --venv /tmp/torchrec-venv
    python -m benchmarks.ebc --compare-torchrec /tmp/torchrec-venv      # the same
    python -m benchmarks.compare_torchrec --venv V --cases table_wise,row_wise --profile

The workload of `benchmarks/ebc.py` (26 Criteo-like tables, dim 64, per-rank batch 2048,
fused exact SGD, loss = sum of the pooled output): for each case, recshard's ranks, then
TorchRec's (`benchmarks/torchrec_ebc.py.txt`, served by VENV's python in a subprocess: TorchRec
is no dependency of the project), then the next case; all cases `--repeats` times (A B A B A B).
Both sides run in fresh rank processes pinned to their own cores, one torch thread per rank
(cases `*_1rank_2threads`: one rank on both cores with two threads), the same tables,
placements, ids, warm-up and timed steps. A run's figure is the median over steps of the
slowest rank's step; the reported one is the median over repeats.

`ratio` is recshard's samples/s over TorchRec's (TorchRec's step / recshard's). `floor_ms` is
the memory-bandwidth floor of the step: the rows one rank-batch looks up (read in forward,
read + written in the fused update) at the sequential copy bandwidth measured at the start of
the run, spread over the rank's cores; `vs_floor` is each side's step over it.
With `--profile`, each case's step is profiled on rank 0 on both sides instead (phases, the
collectives' self time, top ops). Every line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.ebc import measure
from benchmarks.ebc_workload import QUICK, Sizes, copy_bandwidth_gbs, floor_ms, pooling_factors
from benchmarks.ranks import rank_cpus, run_ranks
from benchmarks.torchrec_server import TorchRecServer, emit

TORCHREC_SIDE = Path(__file__).with_name("torchrec_ebc.py.txt")


@dataclass(frozen=True)
class Case:
    """One side-by-side comparison: a plan on `world_size` ranks of `threads` threads."""

    name: str
    plan: str  # table_wise, row_wise, column_wise, table_row_wise, or each library's planner
    world_size: int
    threads: int


CASES = {
    c.name: c
    for c in [
        Case("table_wise", "table_wise", 2, 1),
        Case("row_wise", "row_wise", 2, 1),
        Case("column_wise", "column_wise", 2, 1),
        Case("table_row_wise", "table_row_wise", 2, 1),
        Case("planner", "planner", 2, 1),
        Case("table_wise_1rank_2threads", "table_wise", 1, 2),
    ]
}


def _run_args(case: Case, args: argparse.Namespace) -> argparse.Namespace:
    """What `benchmarks.ebc.measure` and the rank processes read, for this case."""
    return argparse.Namespace(
        threads=case.threads,
        pin=True,
        timeout=args.timeout,
        steps=args.steps,
        warmup=args.warmup,
        batches=args.batches,
        inter_host_gbps=None,
        profile_steps=args.profile_steps,
    )


def _request(case: Case, args: argparse.Namespace, profile: bool) -> Dict[str, Any]:
    return dict(
        plan=case.plan,
        world_size=case.world_size,
        threads=case.threads,
        pin=True,
        timeout=args.timeout,
        steps=args.steps,
        warmup=args.warmup,
        batches=args.batches,
        quick=args.quick,
        profile=profile,
        profile_steps=args.profile_steps,
        top=args.top,
    )


def _slowest_median(per_rank: List[Dict[str, Any]]) -> float:
    return statistics.median(max(step) for step in zip(*(r["times"] for r in per_rank)))


def compare(args: argparse.Namespace) -> None:
    sizes = QUICK if args.quick else Sizes()
    pooling = pooling_factors(26, sizes.max_pooling)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(rank_cpus(0, 1)))  # one core's bandwidth, before any rank runs
    bandwidth = copy_bandwidth_gbs()
    os.sched_setaffinity(0, allowed)
    emit(
        dict(
            bench="compare_setup",
            copy_bandwidth_gbs_per_core=round(bandwidth, 2),
            lookups_per_rank_batch=sum(pooling) * sizes.batch,
            batch_per_rank=sizes.batch,
            dim=sizes.dim,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            cases=[c.name for c in args.cases],
            torchrec_venv=str(args.venv),
        )
    )
    server = TorchRecServer(args.venv, TORCHREC_SIDE)
    try:
        if args.profile:
            for case in args.cases:
                mine = run_ranks(
                    case.world_size,
                    _run_args(case, args),
                    measure,
                    case.plan,
                    sizes,
                    _run_args(case, args),
                    True,
                )[0]["profile"]
                theirs = server.run(_request(case, args, True))[0]["profile"]
                emit({**mine, "bench": "profile", "library": "recshard", "case": case.name})
                emit({**theirs, "bench": "profile", "library": "torchrec", "case": case.name})
            return
        medians: Dict[str, Dict[str, List[float]]] = {
            c.name: {"recshard": [], "torchrec": []} for c in args.cases
        }
        torchrec_kinds: Dict[str, List[str]] = {}
        faults: Dict[str, Dict[str, List[float]]] = {
            c.name: {"recshard": [], "torchrec": []} for c in args.cases
        }
        for _ in range(args.repeats):
            for case in args.cases:
                run_args = _run_args(case, args)
                mine = run_ranks(
                    case.world_size, run_args, measure, case.plan, sizes, run_args, False
                )
                theirs = server.run(_request(case, args, False))
                for side, ranks in (("recshard", mine), ("torchrec", theirs)):
                    medians[case.name][side].append(_slowest_median(ranks))
                    faults[case.name][side].append(max(r["faults_per_step"] for r in ranks))
                torchrec_kinds[case.name] = theirs[0]["sharding_types"]
    finally:
        server.close()
    for case in args.cases:
        kinds = sorted(set(torchrec_kinds.get(case.name, [])))
        ours = statistics.median(medians[case.name]["recshard"])
        theirs = statistics.median(medians[case.name]["torchrec"])
        floor = floor_ms(sizes, pooling, case.threads, bandwidth)
        emit(
            dict(
                bench="compare_torchrec",
                case=case.name,
                plan=case.plan,
                world_size=case.world_size,
                threads_per_rank=case.threads,
                torchrec_sharding_types=kinds,
                recshard_step_ms=round(1e3 * ours, 2),
                torchrec_step_ms=round(1e3 * theirs, 2),
                recshard_samples_per_s=round(case.world_size * sizes.batch / ours),
                torchrec_samples_per_s=round(case.world_size * sizes.batch / theirs),
                ratio=round(theirs / ours, 3),
                recshard_repeats_ms=[round(1e3 * m, 2) for m in medians[case.name]["recshard"]],
                torchrec_repeats_ms=[round(1e3 * m, 2) for m in medians[case.name]["torchrec"]],
                floor_ms=round(floor, 2),
                recshard_vs_floor=round(1e3 * ours / floor, 2),
                torchrec_vs_floor=round(1e3 * theirs / floor, 2),
                recshard_page_faults_per_step=round(
                    statistics.median(faults[case.name]["recshard"])
                ),
                torchrec_page_faults_per_step=round(
                    statistics.median(faults[case.name]["torchrec"])
                ),
            )
        )


def _parse_cases(text: str) -> List[Case]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {unknown or text!r}; choose from {', '.join(CASES)}"
        )
    return [CASES[n] for n in names]


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--venv",
        type=Path,
        required=True,
        help="a venv with TorchRec 1.8 (../shared/TARGETS.md has the recipe)",
    )
    parser.add_argument(
        "--cases",
        type=_parse_cases,
        default=list(CASES.values()),
        help=f"comma-separated, default all: {', '.join(CASES)}",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (3)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs (3)")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile each case on rank 0 on both sides instead of timing",
    )
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="ops listed per profile")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps (smoke test)")
    args = parser.parse_args(argv)
    defaults = (2, 1, 1) if args.quick else (30, 3, 3)
    for attr, default in zip(("steps", "warmup", "repeats"), defaults):
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    return args


def cli(argv: List[str] | None = None) -> None:
    compare(parse_args(argv))


if __name__ == "__main__":
    cli(sys.argv[1:])
