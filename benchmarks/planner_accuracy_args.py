"""The command line of `benchmarks.planner_accuracy` (its docstring says what each run does)."""

from __future__ import annotations

import argparse
from typing import List

from benchmarks.link import add_link_argument

DESCRIPTION = (
    "Planner accuracy: the planner's predicted step time and memory vs measured, per plan."
)
FORCED = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]


def _forced_types(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORCED]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown sharding type(s) {unknown or text!r}; choose from {', '.join(FORCED)}"
        )
    return names


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--dims", default=None, help="16,64,128 (quick: 16)")
    parser.add_argument("--ids", default="uniform,zipf")
    parser.add_argument("--batches-per-rank", default=None, help="512,2048 (quick: 64)")
    parser.add_argument(
        "--workloads",
        default=None,
        help="only these workloads, e.g. d64_zipf_b2048,d16_uniform_b512",
    )
    parser.add_argument("--row-cap", type=int, default=50_000)
    parser.add_argument("--max-pooling", type=int, default=20)
    parser.add_argument("--steps", type=int, default=16, help="timed steps per plan")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="fresh rank processes per plan; measured_ms is the median of "
        "their medians (a run can sit 1.5-2x off for its whole length "
        "on a busy 2-core machine)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2, help="distinct batches cycled")
    parser.add_argument(
        "--stats-samples",
        type=int,
        default=4,
        help="global batches sampled per workload for each table's "
        "CacheStatistics (0: plan and estimate without stats)",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        help="ranks per (simulated) host; default all on one host",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--pin", action="store_true", help="pin rank r to the r-th CPU")
    parser.add_argument("--calibration-budget", type=float, default=35.0)
    parser.add_argument("--profile", default=None, help="use this profile, do not calibrate")
    parser.add_argument("--save-profile", default=None, help="write the calibration here")
    parser.add_argument(
        "--forced",
        type=_forced_types,
        default=list(FORCED),
        help=f"the forced plans to run beside the planner's, default all: {','.join(FORCED)}",
    )
    parser.add_argument(
        "--no-calibration",
        action="store_true",
        help="plan and estimate with the planner's built-in costs (no profile)",
    )
    parser.add_argument(
        "--link-check",
        default=None,
        metavar="PROFILE",
        help="also run the planner's plan under this profile's costs",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    add_link_argument(parser)
    args = parser.parse_args(argv)
    if args.no_calibration and (args.profile or args.save_profile):
        parser.error("--no-calibration plans without a profile: drop --profile / --save-profile")
    args.local_world_size = args.local_world_size or args.world_size
    args.dims = args.dims or ("16" if args.quick else "16,64,128")
    args.batches_per_rank = args.batches_per_rank or ("64" if args.quick else "512,2048")
    if args.quick:
        args.row_cap, args.max_pooling, args.steps, args.warmup = 1000, 4, 2, 1
        args.calibration_budget = min(args.calibration_budget, 3.0)
    return args
