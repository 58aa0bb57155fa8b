"""Calibrating a machine (`calibrate`: kernels, memory, links) and a job's ranks
(`calibrate_job`: that, plus the per-rank fixed memory and a sharded module's step costs) into
the `CalibrationProfile` the planner reads. Every rank measures its kernels at the same time
(as in training); the profile carries rank 0's fits."""

from __future__ import annotations

import logging
import socket
import time

import torch
import torch.distributed as dist

from recshard.calibration.grid import CalibrationGrid
from recshard.calibration.kernels import measure_kernels
from recshard.calibration.links import measure_links
from recshard.calibration.memory import measure_memory, measure_rank_overhead
from recshard.calibration.step import StepProbe, measure_step_costs
from recshard.comm.pg import get_local_size
from recshard.planner.profile import CalibrationProfile

logger = logging.getLogger(__name__)


def calibrate(
    budget_s: float = 35.0,
    grid: CalibrationGrid | None = None,
    pg: dist.ProcessGroup | None = None,
    local_world_size: int | None = None,
) -> CalibrationProfile:
    """Measure kernels (within about `budget_s`), memory and, if a process group is
    initialized (`pg` or the default one), its links; every rank of `pg` must call this."""
    grid = grid or CalibrationGrid()
    start = time.perf_counter()
    group = pg if pg is not None else (dist.group.WORLD if dist.is_initialized() else None)
    world = dist.get_world_size(group) if group is not None else 1
    local = local_world_size or (get_local_size(world) if group is not None else 1)
    profile = CalibrationProfile(
        "cpu", torch.get_num_threads(), world, local, host=socket.gethostname()
    )
    points = len(grid.dims) * len(grid.poolings) * len(grid.batches) * 2 * 2
    per_point_s = 0.8 * budget_s / max(points, 1)
    for dim in grid.dims:
        profile.kernels += measure_kernels(dim, grid, per_point_s)
    profile.memory = measure_memory(grid)
    if group is not None and world > 1:
        dist.barrier(group)
        profile.links = measure_links(group, local, grid)
    profile.seconds = time.perf_counter() - start
    logger.info(
        "calibrated in %.1f s: %d kernel fits, %d link fits",
        profile.seconds,
        len(profile.kernels),
        len(profile.links),
    )
    return profile


def calibrate_job(
    budget_s: float = 35.0,
    grid: CalibrationGrid | None = None,
    pg: dist.ProcessGroup | None = None,
    local_world_size: int | None = None,
    probe: StepProbe | None = None,
) -> CalibrationProfile:
    """`calibrate` (kernels, memory, links), the per-rank fixed memory of a sharded step
    (rank 0, `measure_rank_overhead`), then, among two or more ranks, the sharded
    module's step costs per sharding type (`measure_step_costs`). Every rank calls this and
    gets the same profile: rank 0's kernel fits are shared before the step probe is planned
    (plans from each rank's own fits can differ, and mismatched modules hang or fail gloo)."""
    start = time.perf_counter()
    profile = calibrate(budget_s, grid, pg, local_world_size)
    group = pg if pg is not None else (dist.group.WORLD if dist.is_initialized() else None)
    if profile.memory is not None and (group is None or dist.get_rank(group) == 0):
        profile.memory.rank_overhead_bytes = measure_rank_overhead() or 0.0
    if group is not None and profile.world_size > 1:
        shared = [profile]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        profile = shared[0]
        profile.steps = measure_step_costs(group, profile, probe)
        profile.seconds = time.perf_counter() - start
    return profile
