"""`recshard-plan calibrate -o profile.json [--budget S] [--quick]`: measure this machine.

Alone it measures the lookup kernels; under torchrun (`torchrun --nproc_per_node N -m
recshard.planner calibrate -o profile.json`) every rank also measures the links between the
job's ranks (inside a host and, with several hosts, across hosts), and rank 0 writes the file.
`torchrun ... -m recshard.distributed.calibrate_step -o profile.json` runs the same and adds a
real sharded module's step costs (it builds sharded modules, a layer above the planner).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Callable, List

import torch.distributed as dist

from recshard.planner.calibrate import CalibrationGrid, calibrate
from recshard.planner.profile import CalibrationProfile

Measure = Callable[[float, CalibrationGrid], CalibrationProfile]


def calibrate_main(
    argv: List[str], measure: Measure = calibrate, prog: str = "recshard-plan calibrate"
) -> int:
    """Parse `argv`, run `measure(budget, grid)` on every rank, rank 0 writes the profile
    (`recshard.distributed.calibrate_step` passes its job calibration)."""
    p = argparse.ArgumentParser(
        prog=prog, description="Measure kernel and link costs into a profile."
    )
    p.add_argument("-o", "--output", required=True, help="write the profile (JSON) here")
    p.add_argument(
        "--budget",
        type=float,
        default=35.0,
        help="seconds for the kernel measurements (default 35; memory probes and "
        "links take a few more)",
    )
    p.add_argument("--quick", action="store_true", help="tiny grid (a smoke test)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.budget <= 0:
        print(f"error: --budget must be > 0, got {args.budget}", file=sys.stderr)
        return 1
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        dist.init_process_group("gloo")
    try:
        grid = CalibrationGrid.quick() if args.quick else CalibrationGrid()
        profile = measure(args.budget, grid)
        if not launched or dist.get_rank() == 0:
            profile.save(args.output)
            summary = {
                "profile": args.output,
                "seconds": round(profile.seconds, 1),
                "kernel_fits": len(profile.kernels),
                "links": {
                    f"{c.collective}/{c.level}": {
                        "gbps": round(c.gbps, 3),
                        "latency_ms": round(c.latency_ms, 4),
                    }
                    for c in profile.links
                },
            }
            print(json.dumps(summary))
    finally:
        if launched:
            dist.destroy_process_group()
    return 0
