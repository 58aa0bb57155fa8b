"""`recshard-plan`: `recshard-plan calibrate -o profile.json [--budget S] [--quick]
[--storage DIR]` measures this machine and job (and with `--storage` the key-value tables'
storage); anything else plans (`recshard.planner.report.cli`).

Alone, `calibrate` measures the lookup kernels and memory; under torchrun
(`torchrun --nproc_per_node N -m recshard.calibration -o profile.json`, or
`torchrun ... --no-python recshard-plan calibrate -o profile.json`) every rank also measures
the links between the job's ranks (inside a host and, with several hosts, across hosts) and a
real sharded module's step costs per sharding type; rank 0 writes the file.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import List, Sequence

import torch.distributed as dist

from recshard.calibration.grid import CalibrationGrid
from recshard.calibration.machine import calibrate_job
from recshard.calibration.step import StepProbe
from recshard.calibration.storage import measure_storage
from recshard.planner.report.cli import main as plan_main


def calibrate_main(argv: List[str], prog: str = "recshard-plan calibrate") -> int:
    """Parse `argv`, run `calibrate_job` on every rank (a process group when launched by
    torchrun), rank 0 writes the profile and prints a JSON summary."""
    p = argparse.ArgumentParser(
        prog=prog, description="Measure kernel, memory, link and step costs into a profile."
    )
    p.add_argument("-o", "--output", required=True, help="write the profile (JSON) here")
    p.add_argument(
        "--budget",
        type=float,
        default=35.0,
        help="seconds for the kernel measurements (default 35; memory probes, links and "
        "step probes take more)",
    )
    p.add_argument("--quick", action="store_true", help="tiny grid and probes (a smoke test)")
    p.add_argument(
        "--storage",
        metavar="DIR",
        help="also measure key_value storage here (random row reads and write-backs on a "
        "probe file of --storage-mb, removed afterwards; rank 0)",
    )
    p.add_argument(
        "--storage-mb", type=int, default=64, help="the storage probe's file (default 64 MiB)"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not (math.isfinite(args.budget) and args.budget > 0):
        p.error(f"--budget must be a finite number of seconds > 0, got {args.budget}")
    if args.storage is not None and not os.path.isdir(args.storage):
        p.error(f"--storage '{args.storage}' is not a directory")
    if not 1 <= args.storage_mb <= 1 << 20:
        p.error(f"--storage-mb must be between 1 and {1 << 20}, got {args.storage_mb}")
    grid, probe = (
        (CalibrationGrid.quick(), StepProbe.quick())
        if args.quick
        else (CalibrationGrid(), StepProbe())
    )
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        dist.init_process_group("gloo")
    try:
        profile = calibrate_job(args.budget, grid, probe=probe)
        if not launched or dist.get_rank() == 0:
            if args.storage is not None:
                profile.storage = measure_storage(args.storage, args.storage_mb << 20)
            profile.save(args.output)
            summary = {
                "profile": args.output,
                "seconds": round(profile.seconds, 1),
                "kernel_fits": len(profile.kernels),
                "step_fits": len(profile.steps),
                "storage_gbps": {
                    "read": round(profile.storage.read_gbps, 4),
                    "write": round(profile.storage.write_gbps, 4),
                }
                if profile.storage is not None
                else None,
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


def main(argv: Sequence[str] | None = None) -> int:
    """`recshard-plan calibrate ...` measures; `recshard-plan TABLES_FILE ...` plans."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        return calibrate_main(argv[1:])
    return plan_main(argv)
