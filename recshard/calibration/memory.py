"""Measuring memory (CPU, Linux), each probe in a fresh process (`recshard.calibration.fresh`).

The fused kernel's peak resident growth while building tables of two sizes (fit: per byte of
weights + a fixed part) and during a first step (`measure_memory`). And the per-rank fixed
memory of a sharded training step (`measure_rank_overhead`): a sharded module's first steps
grow a process's resident memory by a roughly fixed amount whatever its tables (the code pages
of the kernels, autograd and collectives first touched, the autograd engine's and gloo's
threads and buffers, the allocator's first arenas: about 10-12 MB per rank on the development
machine, 2 gloo ranks).
"""

from __future__ import annotations

import socket
import statistics
from typing import List, Tuple

import torch
import torch.distributed as dist

from recshard.calibration import fresh
from recshard.calibration.fitting import Sample, fit_build, fit_costs
from recshard.calibration.grid import CalibrationGrid
from recshard.calibration.kernels import LR, build_lookup, random_batch
from recshard.calibration.procfs import peak_bytes, reset_peak
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.modules.embedding_configs import EmbeddingBagConfig
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.planner import EmbeddingShardingPlanner, Topology
from recshard.planner.profile import MemoryCost
from recshard.sparse import KeyedJaggedTensor, jagged_ops
from recshard.types import EmbeddingComputeKernel, ShardingEnv

PROBE_RUNS = 1  # rank-overhead process groups (seconds each: imports); median over them, ranks
PROBE_STEPS = 3
PROBE_RANKS = 2


def memory_probe(tables: int, rows: int, dim: int, batch: int, pooling: int) -> List[float]:
    """In a fresh process: [peak growth building the tables, peak growth of the first
    step; 0 when `pooling` is 0: no step] in bytes. Fresh, because an allocator that already
    holds freed memory hides a step's allocations from the resident size. fbgemm is loaded
    before the baseline, as a job's ranks have it loaded (their input KJTs' ops) before they
    build tables: its ~55 MB of code and data are the process's, not the tables'. The step's
    output gradient is a real buffer, as a sharded module's output dist delivers it (the
    all-to-all's or all-gather's receive buffer), not `sum()`'s expanded one."""
    jagged_ops.fbgemm_available()
    kjt = random_batch(tables, rows, batch, pooling, seed=pooling) if pooling else None
    before = reset_peak()
    lookup = build_lookup(EmbeddingComputeKernel.FUSED, tables, rows, dim)
    build = peak_bytes() - before
    if kjt is None:
        return [build, 0.0]
    start = reset_peak()
    pooled = lookup(kjt)
    pooled.backward(torch.ones_like(pooled))
    return [build, peak_bytes() - start]


def measure_memory(grid: CalibrationGrid) -> MemoryCost | None:
    """Peak resident growth of the fused kernel, one fresh process each: `grid.tables`
    tables of the largest size, built and stepped at the largest batch and the smallest and
    largest pooling factors, each `grid.memory_repeats` times (the median step growth: the two
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
        for _ in range(grid.memory_repeats if pooling else 1):
            measured = fresh.run("memory", (tables, rows, dim, batch, pooling), "memory")
            if measured is None:
                return None
            build, step = measured
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


def rank_overhead_probe(port: int, rank: int) -> float:
    """In a fresh process, rank `rank` of a `PROBE_RANKS`-rank gloo group on this host: the
    peak resident growth (bytes) of building a sharded module of one tiny table per rank and
    training it `PROBE_STEPS` steps (fbgemm loaded first, as a job's ranks have it)."""
    jagged_ops.fbgemm_available()
    store = dist.TCPStore("127.0.0.1", port, PROBE_RANKS, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=PROBE_RANKS)
    configs = [
        EmbeddingBagConfig(num_embeddings=8, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(PROBE_RANKS)
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [c.feature_names[0] for c in configs],
        torch.arange(4 * PROBE_RANKS),
        torch.ones(4 * PROBE_RANKS, dtype=torch.int32),
        stride=4,
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LR}
    )
    plan = EmbeddingShardingPlanner(Topology(PROBE_RANKS), 4, debug=False).plan(
        EmbeddingBagCollection(configs, device="meta"), [sharder]
    )
    before = reset_peak()
    ebc = EmbeddingBagCollection(configs, device="meta")
    module = sharder.shard(ebc, plan.plan[""], ShardingEnv.from_process_group(dist.group.WORLD))
    for _ in range(PROBE_STEPS):
        module(kjt).values().sum().backward()
    growth = peak_bytes() - before
    dist.destroy_process_group()
    return growth


def measure_rank_overhead() -> float | None:
    """The median over `PROBE_RUNS` fresh process groups and their ranks of
    `rank_overhead_probe` (bytes); None where it cannot be measured (not Linux, /proc not
    writable)."""
    runs = []
    for _ in range(PROBE_RUNS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [fresh.start("rank_overhead", (port, rank)) for rank in range(PROBE_RANKS)]
        for proc in procs:
            growth = fresh.result(proc, "per-rank memory overhead")
            if growth is None:
                return None
            runs.append(float(growth))
    return statistics.median(runs)
