"""Timing the links among a job's ranks: all-to-all, reduce-scatter and all-gather (as the
sharded modules issue them, through the transport training uses) and the backend's all-reduce,
over a few buffer sizes, among the ranks of a host and, with several hosts, among the ranks
of equal local rank across hosts; fit `latency + bytes / bandwidth`."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from recshard.calibration.fitting import fit_link, fit_rate
from recshard.calibration.grid import CalibrationGrid
from recshard.comm.pg import intra_and_cross_node_pg
from recshard.comm.pooled_reduce import all_gather_base_pooled, reduce_scatter_base_pooled
from recshard.comm.request import issue_all_to_all
from recshard.planner.profile import LinkCost


def _collectives(group: dist.ProcessGroup) -> Dict[str, Callable[[torch.Tensor], None]]:
    """The collectives as the sharded modules issue them (`recshard.comm`): through the
    transport training uses (shared memory among the ranks of one host, else the backend);
    and the backend's all-reduce, which averages data-parallel gradients."""
    world = dist.get_world_size(group)

    def all_to_all(buf: torch.Tensor) -> None:
        splits = [buf.numel() // world] * world
        issue_all_to_all(buf, splits, splits, group, name="calibrate_all_to_all").wait()

    return {
        "all_to_all": all_to_all,
        "reduce_scatter": lambda buf: reduce_scatter_base_pooled(buf.view(world, -1), group).wait(),
        "all_gather": lambda buf: all_gather_base_pooled(
            buf[: buf.numel() // world].view(1, -1), group
        ).wait(),
        "all_reduce": lambda buf: dist.all_reduce(buf, group=group),
    }


def measure_links(
    group: dist.ProcessGroup, local_world_size: int, grid: CalibrationGrid
) -> List[LinkCost]:
    """Latency and bandwidth of each collective inside a host and, with several hosts,
    across hosts. Every rank runs the same calls in the same order."""
    world = dist.get_world_size(group)
    levels: List[Tuple[str, dist.ProcessGroup]] = []
    if local_world_size >= world:
        levels.append(("intra", group))
    else:
        intra, cross = intra_and_cross_node_pg(group, local_world_size)
        if local_world_size > 1:
            levels.append(("intra", intra))
        levels.append(("inter", cross))
    out: List[LinkCost] = []
    for level, sub in levels:
        n = dist.get_world_size(sub)
        for name, op in _collectives(sub).items():
            points: List[Tuple[float, float]] = []
            for size in grid.all_reduce_bytes if name == "all_reduce" else grid.link_bytes:
                elems = max(n, size // 4 // n * n)
                buf = torch.ones(elems, dtype=torch.float32)
                op(buf)  # warm-up
                times = []
                for _ in range(grid.link_repeats):
                    dist.barrier(sub)
                    t0 = time.perf_counter()
                    op(buf)
                    times.append(1e3 * (time.perf_counter() - t0))
                sent = 4.0 * elems * (n - 1) / n
                points.append((sent, statistics.median(times)))
            latency, ms_per_byte = (fit_rate if name == "all_reduce" else fit_link)(points)
            out.append(LinkCost(name, level, n, 1e-6 / ms_per_byte, latency))
    return out
