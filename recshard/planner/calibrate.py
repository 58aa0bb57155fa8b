"""Measure this machine's costs into a `CalibrationProfile` (`recshard-plan calibrate`).

Kernels: recshard's fused and dense lookup kernels (`GroupedLookup`, exact SGD), forward and
backward + update, over a grid of embedding dims, pooling factors, batch sizes and table
sizes, each point the median of a few timed calls; one least-squares fit per kernel,
phase and dim (see `recshard.planner.profile`). Links, when a process group is up (torchrun):
all-to-all, reduce-scatter and all-gather over a few buffer sizes among the ranks of a host
and, with several hosts, among the ranks of equal local rank across hosts; fit `latency +
bytes / bandwidth`. Memory (Linux): the fused kernel's peak resident growth while building
tables of two sizes (fit: per byte of weights + a fixed part) and during a first step (peak
reset through `/proc/self/clear_refs`). Every rank measures its kernels at the same time (as
in training); the profile carries rank 0's fits.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from recshard.comm.ops import all_gather_base_pooled, reduce_scatter_base_pooled
from recshard.comm.pg import get_local_size, intra_and_cross_node_pg
from recshard.comm.request import issue_all_to_all
from recshard.lookup import GroupedLookup, LocalTable
from recshard.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from recshard.planner.profile import (
    CalibrationProfile,
    KernelCost,
    LinkCost,
    MemoryCost,
    distinct_rows,
)
from recshard.sparse import KeyedJaggedTensor, jagged_ops
from recshard.types import EmbeddingComputeKernel

logger = logging.getLogger(__name__)

_LR = 0.01


@dataclass(frozen=True)
class CalibrationGrid:
    """What to measure. The default takes about 45 s on one quiet CPU core (kernels within
    `budget_s`, then three memory probes and the links); `quick()` a few s."""

    dims: Tuple[int, ...] = (16, 64, 128)
    poolings: Tuple[int, ...] = (1, 4, 32)
    batches: Tuple[int, ...] = (256, 2048)
    rows: Tuple[int, ...] = (2_000, 100_000)  # a cache-resident and a cold table
    tables: int = 4  # working sets of 100-400 MB, as a rank's tables
    link_bytes: Tuple[int, ...] = (1 << 14, 1 << 18, 1 << 21, 1 << 23)
    # the backend's all-reduce carries data-parallel gradients, MBs each: its rate is timed
    # on gradient-sized calls (`fit_rate`)
    all_reduce_bytes: Tuple[int, ...] = (1 << 23, 1 << 25)
    link_repeats: int = 7

    @classmethod
    def quick(cls) -> CalibrationGrid:
        return cls(
            dims=(16, 32),
            poolings=(1, 4),
            batches=(32, 128),
            rows=(200, 2000),
            link_bytes=(1 << 10, 1 << 14, 1 << 16),
            all_reduce_bytes=(1 << 14, 1 << 16),
            link_repeats=3,
        )


def calibrate(
    budget_s: float = 35.0,
    grid: CalibrationGrid | None = None,
    pg: dist.ProcessGroup | None = None,
    local_world_size: int | None = None,
) -> CalibrationProfile:
    """Measure kernels (within about `budget_s`) and, if a process group is initialized
    (`pg` or the default one), its links; every rank of `pg` must call this."""
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


# ----------------------------------------------------------------------------- kernels


def _lookup(kernel: EmbeddingComputeKernel, tables: int, rows: int, dim: int) -> GroupedLookup:
    local = [
        LocalTable(
            EmbeddingBagConfig(
                num_embeddings=rows, embedding_dim=dim, name=f"t{t}", feature_names=[f"f{t}"]
            ),
            rows,
            dim,
            0,
            0,
            kernel,
            PoolingType.SUM,
            {"optimizer": "exact_sgd", "learning_rate": _LR},
        )
        for t in range(tables)
    ]
    return GroupedLookup(local, pooled=True, device=torch.device("cpu"))


def _batch(tables: int, rows: int, batch: int, pooling: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    return KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(tables)],
        values=torch.randint(0, rows, (tables * batch * pooling,), generator=g),
        lengths=torch.full((tables * batch,), pooling, dtype=torch.int64),
    )


def _median_ms(fn: Callable[[], None], budget_s: float, min_calls: int = 3) -> float:
    fn()  # warm-up
    times: List[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_calls or (time.perf_counter() < deadline and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _time_point(
    lookup: GroupedLookup,
    sgd: torch.optim.Optimizer | None,
    kjt: KeyedJaggedTensor,
    budget_s: float,
) -> Tuple[float, float]:
    """Median ms of a forward, and of a forward + backward + update."""

    def forward() -> None:
        lookup(kjt)

    def step() -> None:
        lookup(kjt).sum().backward()
        if sgd is not None:
            sgd.step()
            sgd.zero_grad(set_to_none=True)

    return _median_ms(forward, budget_s / 2), _median_ms(step, budget_s / 2)


Sample = Tuple[float, float, float, float]  # ids, bags, elements, ms


def measure_kernels(dim: int, grid: CalibrationGrid, per_point_s: float) -> List[KernelCost]:
    """Fits for the fused and dense kernels at `dim`, forward and backward + update, each
    timed on tables of the smallest and the largest size of `grid.rows` (cache-resident and
    cold): an id costs `ms_per_id` in the small tables and `ms_per_id_cold` in the large ones.
    The dense update's elements are the whole table; the fused update's, the distinct rows
    looked up times the dim, so one fit prices any table size and batch (a small table's ids
    are mostly repeats)."""
    hot, cold = min(grid.rows), max(grid.rows)
    features: Dict[Tuple[str, str], List[List[float]]] = {}
    times: Dict[Tuple[str, str], List[float]] = {}
    for name, kernel in (
        ("fused", EmbeddingComputeKernel.FUSED),
        ("dense", EmbeddingComputeKernel.DENSE),
    ):
        for rows in (hot, cold):
            lookup = _lookup(kernel, grid.tables, rows, dim)
            params = [p for p in lookup.parameters() if p.requires_grad]
            sgd = torch.optim.SGD(params, lr=_LR) if params else None
            for batch in grid.batches:
                for pooling in grid.poolings:
                    kjt = _batch(grid.tables, rows, batch, pooling, seed=dim + pooling)
                    fwd, total = _time_point(lookup, sgd, kjt, per_point_s)
                    ids = float(grid.tables * batch * pooling)
                    updated = rows if name == "dense" else distinct_rows(rows, ids / grid.tables)
                    work = [
                        ids if rows == hot else 0.0,
                        ids if rows == cold else 0.0,
                        float(grid.tables * batch),
                        float(grid.tables * updated * dim),
                    ]
                    for phase, ms in (("fwd", fwd), ("bwd", max(total - fwd, 0.0))):
                        features.setdefault((name, phase), []).append(work)
                        times.setdefault((name, phase), []).append(ms)
    out = []
    for (name, phase), x in features.items():
        with_elements = name == "dense" or phase == "bwd"
        coef, per_call = fit_kernel(
            [row if with_elements else row[:3] for row in x], times[(name, phase)]
        )
        per_element = coef[3] if with_elements else 0.0
        out.append(
            KernelCost(
                name,
                phase,
                dim,
                coef[0],
                coef[2],
                per_element,
                per_call,
                ms_per_id_cold=coef[1],
                hot_rows=hot,
                cold_rows=cold,
            )
        )
    return out


def fit_kernel(x: Sequence[Sequence[float]], ms: Sequence[float]) -> Tuple[List[float], float]:
    """`fit_nonnegative` of a kernel's points, columns (hot-table ids, cold-table ids, bags[,
    elements]). Where one table size's ids come out free and the other's not, that is noise
    (a short calibration's tiny calls), not a cache: both get one price fitted over all ids."""
    coef, per_call = fit_nonnegative(x, ms)
    if (coef[0] == 0.0) != (coef[1] == 0.0):
        merged, per_call = fit_nonnegative([[r[0] + r[1], *r[2:]] for r in x], ms)
        coef = [merged[0], *merged]
    return coef, per_call


def fit_nonnegative(
    x: Sequence[Sequence[float]], ms: Sequence[float], intercept: bool = True
) -> Tuple[List[float], float]:
    """Non-negative least squares of `ms ~ x . coef + per_call`, weighted by `1 / sqrt(ms)`:
    per-id costs grow with the working set (caches), and the large calls are what a training
    step is made of; a negative coefficient is dropped and the rest refitted (where the last
    work term left is negative, the per-call term goes instead: alone, it would price any
    amount of work at 0 ms). A term no point has gets 0. (coef, per_call)."""
    width = len(x[0])
    columns = [c for c in range(width) if any(row[c] for row in x)]
    columns += [width] if intercept else []
    if not columns:
        return [0.0] * width, 0.0
    y = torch.tensor(list(ms), dtype=torch.float64)
    weight = 1.0 / y.clamp_min(1e-3).sqrt()
    full = torch.tensor([list(row) + [1.0] for row in x], dtype=torch.float64)
    while True:
        coef = torch.linalg.lstsq(
            full[:, columns] * weight[:, None], (y * weight)[:, None]
        ).solution[:, 0]
        negative = [c for c, v in zip(columns, coef.tolist()) if v < 0]
        if not negative or len(columns) == 1:
            break
        drop = negative[0]
        if [c for c in columns if c != width] == [drop] and width in columns:
            drop = width
        columns = [c for c in columns if c != drop]
    values = [0.0] * (width + 1)
    for c, v in zip(columns, coef.tolist()):
        values[c] = max(v, 0.0)
    return values[:width], values[width]


def fit_costs(
    points: Sequence[Sample], with_elements: bool, intercept: bool = True
) -> Tuple[float, float, float, float]:
    """(per id, per bag, per element, per call) of `ms ~ ids a + bags b + elements c + d`
    over (ids, bags, elements, ms) points (`fit_nonnegative`)."""
    width = 3 if with_elements else 2
    coef, per_call = fit_nonnegative([p[:width] for p in points], [p[3] for p in points], intercept)
    coef += [0.0] * (3 - width)
    return coef[0], coef[1], coef[2], per_call


# ----------------------------------------------------------------------------- memory


MEMORY_REPEATS = 3  # fresh processes per step probe of `measure_memory`


def _rss_bytes() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> float:
    """Reset the peak resident size to now (Linux >= 4.0); the current resident bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_bytes()


def peak_bytes() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return 1024.0 * int(line.split()[1])
    raise OSError("no VmHWM in /proc/self/status")


def memory_probe(tables: int, rows: int, dim: int, batch: int, pooling: int) -> str:
    """In a fresh process: (peak growth building the tables, peak growth of the first
    step; 0 when `pooling` is 0: no step) in bytes, as JSON. Fresh, because an allocator
    that already holds freed memory hides a step's allocations from the resident size.
    fbgemm is loaded before the baseline, as a job's ranks have it loaded (their input KJTs'
    ops) before they build tables: its ~55 MB of code and data are the process's, not the
    tables'. The step's output gradient is a real buffer, as a sharded module's output dist
    delivers it (the all-to-all's or all-gather's receive buffer), not `sum()`'s expanded one."""
    jagged_ops.fbgemm_available()
    kjt = _batch(tables, rows, batch, pooling, seed=pooling) if pooling else None
    before = reset_peak()
    lookup = _lookup(EmbeddingComputeKernel.FUSED, tables, rows, dim)
    build = peak_bytes() - before
    if kjt is None:
        return json.dumps([build, 0.0])
    start = reset_peak()
    pooled = lookup(kjt)
    pooled.backward(torch.ones_like(pooled))
    return json.dumps([build, peak_bytes() - start])


def fit_build(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(bytes per byte of weights, fixed bytes) of `build ~ factor weights + fixed` over
    (weights, build growth) points of two or more sizes; the factor is at least 1 (the
    weights are resident once built), the fixed part at least 0."""
    if len({w for w, _ in points}) < 2:
        raise ValueError(f"fit_build needs builds of two or more sizes, got {list(points)}")
    x = torch.tensor([[w, 1.0] for w, _ in points], dtype=torch.float64)
    y = torch.tensor([[b] for _, b in points], dtype=torch.float64)
    factor = max(torch.linalg.lstsq(x, y).solution[0, 0].item(), 1.0)
    fixed = statistics.median(b - factor * w for w, b in points)
    return factor, max(fixed, 0.0)


def measure_memory(grid: CalibrationGrid) -> MemoryCost | None:
    """Peak resident growth of the fused kernel, one fresh process each: `grid.tables`
    tables of the largest size, built and stepped at the largest batch and the smallest and
    largest pooling factors, each `MEMORY_REPEATS` times (the median step growth: the two
    step probes alone fix both per-id and per-output costs; the per-id cost still came out
    16.8 or 21.5 bytes in different calibrations), and half as many tables built only
    (builds of two sizes for `fit_build`); None where that cannot be measured (not Linux,
    /proc not writable)."""
    rows, dim, batch = grid.rows[-1], grid.dims[-1], grid.batches[-1]
    half = max(grid.tables // 2, 1)
    probes = [(grid.tables, grid.poolings[0]), (grid.tables, grid.poolings[-1]), (half, 0)]
    points: List[Sample] = []
    builds: List[Tuple[float, float]] = []
    for tables, pooling in probes:
        steps = []
        for _ in range(MEMORY_REPEATS if pooling else 1):
            code = (
                "from recshard.planner.calibrate import memory_probe; "
                f"print(memory_probe({tables}, {rows}, {dim}, {batch}, {pooling}))"
            )
            proc = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                timeout=300,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            if proc.returncode != 0:
                logger.warning("memory not calibrated: %s", proc.stderr.strip()[-500:])
                return None
            build, step = json.loads(proc.stdout.strip().splitlines()[-1])
            builds.append((4.0 * tables * rows * dim, build))
            steps.append(max(step, 0.0))
        if pooling:
            points.append(
                (
                    float(tables * batch * pooling),
                    4.0 * tables * batch * dim,
                    0.0,
                    statistics.median(steps),
                )
            )
    per_id, per_out, _, _ = fit_costs(points, with_elements=False, intercept=False)
    factor, fixed = fit_build(builds)
    return MemoryCost(factor, per_id, per_out, build_fixed_bytes=fixed)


# ----------------------------------------------------------------------------- links


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


def fit_rate(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(0 latency, ms per byte over all `points`): for gloo's all-reduce, whose small calls
    take either ~0.3 or ~4 ms here (a median of 7 flips between them), so a fitted latency
    swings 0-3 ms; a step's per-call costs are the step probes' to measure."""
    return 0.0, sum(ms for _, ms in points) / sum(b for b, _ in points)


def fit_link(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(latency ms, ms per byte) of `ms ~ latency + bytes / bw` (relative least squares);
    both kept positive."""
    x = torch.tensor([[1.0, b] for b, _ in points], dtype=torch.float64)
    y = torch.tensor([ms for _, ms in points], dtype=torch.float64)
    weight = 1.0 / y.clamp_min(1e-4)
    latency, per_byte = (
        torch.linalg.lstsq(x * weight[:, None], (y * weight)[:, None]).solution[:, 0].tolist()
    )
    if per_byte <= 0:  # flat timings: all latency; take the largest point's rate
        per_byte = max(ms / b for b, ms in points)
    return max(latency, 0.0), per_byte
