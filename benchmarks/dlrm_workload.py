"""The side-by-side DLRM step's workload and its timing, in plain torch.

Plain torch on purpose: `benchmarks/dlrm_compare.py` runs recshard's side with it and
`benchmarks/torchrec_dlrm.py.txt` (a TorchRec venv's python) runs TorchRec's, so both train the
same DLRM (the 26 Criteo-like tables of `ebc_workload`, dim 64, dense arch 13 -> 512 -> 256 -> 64,
over arch -> 512 -> 256 -> 1, BCE) on the same dense features, ids and labels, and time the
same two loops: the plain one (zero_grad, forward, backward, optimizer step) and
`TrainPipelineSparseDist.progress`. Each side supplies only what differs: how it builds a
batch and its sharded model and optimizer.
"""

from __future__ import annotations

import itertools
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from benchmarks.ebc_workload import QUICK, Sizes, batch_tensors, pooling_factors, table_rows
from benchmarks.ranks import minor_faults, timed_steps, warm_up

NUM_DENSE = 13
DENSE_ARCH = [512, 256, 64]
OVER_ARCH = [512, 256, 1]
QUICK_DENSE_ARCH = [32, 16]  # the last layer is the embedding dim (QUICK.dim)
QUICK_OVER_ARCH = [16, 1]
LEARNING_RATE = 0.01
EPS = 1e-8
PLANS = ("planner", "table_wise", "row_wise")
LOOPS = ("plain", "pipeline")
DATA_TYPES = ("FP32", "FP16")  # the tables' weights


@dataclass(frozen=True)
class Arch:
    """Table sizes, pooling factors and MLP layer sizes of one run (full or `--quick`)."""

    sizes: Sizes
    rows: List[int]
    pooling: List[int]
    dense_arch: List[int]
    over_arch: List[int]
    data_type: str = "FP32"  # the tables' `DataType` name (FP32 or FP16 weights)


def arch(quick: bool, data_type: str = "FP32") -> Arch:
    sizes = QUICK if quick else Sizes()
    rows = table_rows(sizes)
    return Arch(
        sizes=sizes,
        rows=rows,
        pooling=pooling_factors(len(rows), sizes.max_pooling),
        dense_arch=QUICK_DENSE_ARCH if quick else DENSE_ARCH,
        over_arch=QUICK_OVER_ARCH if quick else OVER_ARCH,
        data_type=data_type,
    )


def feature_names(num_tables: int) -> List[str]:
    return [f"cat_{i}" for i in range(num_tables)]


def batch_parts(
    a: Arch, seed: int, count: int
) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`count` (dense [B, 13], ids, lengths, labels [B]) of one rank's batches: the ids of
    `ebc_workload.batch_tensors`, standard-normal dense features, 0/1 labels."""
    g = torch.Generator().manual_seed(10_000 + seed)
    b = a.sizes.batch
    return [
        (
            torch.randn(b, NUM_DENSE, generator=g),
            values,
            lengths,
            torch.randint(0, 2, (b,), generator=g).float(),
        )
        for values, lengths in batch_tensors(a.rows, a.pooling, b, seed=seed, count=count)
    ]


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _profiled(step: Callable[[int], None], steps: int, top: int) -> Dict[str, Any] | None:
    """torch.profiler over `steps` steps on rank 0 (the others run them unprofiled): step time
    and the `top` ops by self CPU time, per step. None on other ranks."""
    from torch.profiler import ProfilerActivity, profile

    if dist.get_rank() != 0:
        for i in range(steps):
            step(i)
        return None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        wall_ms = 1e3 * (time.perf_counter() - start)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return dict(
        step_ms=round(wall_ms / steps, 2),
        top_ops=[
            dict(
                op=e.key,
                self_ms=round(e.self_cpu_time_total / 1e3 / steps, 2),
                calls=round(e.count / steps, 1),
            )
            for e in ops[:top]
        ],
    )


def measure(
    request: Dict[str, Any],
    make_batch: Callable[..., Any],
    build: Callable[[str, Arch], Tuple[Any, Any, Any, List[str]]],
) -> Dict[str, Any]:
    """One run of one case on this rank (inside a fresh process group).

    `make_batch(dense, keys, values, lengths, labels)` is the library's `Batch`;
    `build(plan, arch)` returns (the sharded `DLRMTrain`, its combined optimizer, the
    library's `TrainPipelineSparseDist` class, the plan's sharding types). Returns this rank's
    step seconds, its CPU time per step (every thread of the process: the step's work, without
    the time it waited for a peer or for its core), page faults per step, peak RSS and the
    sharding types (or the profile).
    """
    a = arch(request["quick"], request.get("data_type", "FP32"))
    keys = feature_names(len(a.rows))
    batches = [
        make_batch(dense, keys, values, lengths, labels)
        for dense, values, lengths, labels in batch_parts(
            a, seed=1 + dist.get_rank(), count=request["batches"]
        )
    ]
    model, optimizer, pipeline_class, kinds = build(request["plan"], a)
    if request["loop"] == "pipeline":
        pipeline = pipeline_class(model, optimizer, torch.device("cpu"))
        stream = itertools.cycle(batches)

        def step(i: int) -> None:
            pipeline.progress(stream)

    else:

        def step(i: int) -> None:
            optimizer.zero_grad()
            loss, _ = model(batches[i % len(batches)])
            loss.backward()
            optimizer.step()

    warm_up(step, request["warmup"])
    if request["profile"]:
        return {"profile": _profiled(step, request["profile_steps"], request["top"])}
    faults, cpu = minor_faults(), time.process_time()
    times = timed_steps(step, request["steps"])
    faults, cpu = minor_faults() - faults, time.process_time() - cpu
    return {
        "times": times,
        "cpu_ms_per_step": round(1e3 * cpu / request["steps"], 2),
        "faults_per_step": faults / request["steps"],
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "sharding_types": kinds,
        "median_ms": round(1e3 * statistics.median(times), 2),
    }
