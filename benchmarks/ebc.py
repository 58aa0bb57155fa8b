"""Sharded EmbeddingBagCollection training step: samples/s per sharding type, plus kernels.

    python -m benchmarks.ebc                        # 2 gloo ranks on this machine
    python -m benchmarks.ebc --types table_wise,row_wise --steps 50
    python -m benchmarks.ebc --quick                # tiny sizes (smoke test)
    python -m benchmarks.ebc --link 1gbit --types table_wise,table_wise_fp16,table_wise_bf16
    python -m benchmarks.ebc --compare-torchrec /tmp/torchrec-venv   # side by side with TorchRec
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint host0:29500 \
        -m benchmarks.ebc --types row_wise,table_row_wise   # the launched ranks, on 2 hosts

Work (TARGETS.md, "Sharded EBC training step"): 26 Criteo-like tables (Kaggle sizes capped at
200 k rows: 1.48 M rows), dim 64, one feature each, a fixed pooling factor 1-20 per table
(seed 0: 606 k lookups per rank-batch), uniform ids, per-rank batch 2048. One step is
forward + backward + update of the sharded EBC with `values().sum()` as the loss: the fused
kernels update in backward (exact SGD), the dense ones take a `torch.optim.SGD` step.

Configurations run interleaved (every configuration once per repeat, `--repeats` times), each
run in fresh rank processes (under torchrun: in the launched ranks, one after another, and
`--world-size` is torchrun's); a repeat's figure is the median of `--steps` step times, each the
slowest rank's, and the reported figure is the median over repeats. `rss_growth_mb_per_step`
is the resident memory a rank gains per timed step (0 when nothing outlives a step). Also printed:
a single-process kernel comparison at torch's thread count (recshard's fused kernel vs its
dense kernel + `torch.optim.SGD`, and the fbgemm TBE / `nn.EmbeddingBag` they build on) and a
torch.profiler view of one table-wise step on rank 0. Every line on stdout is one JSON object.
`--link RATE` re-runs everything on a loopback shaped to RATE (`benchmarks/link.py`; every line
gets `link`); `wait_share` is rank 0's time blocked in collective waits over its step time, by
kind. `table_wise_fp16` / `table_wise_bf16` send the pooled all-to-all (both ways) in that dtype;
`table_wise_fp16_weights` / `row_wise_fp16_weights` train FP16 tables (`DataType.FP16`).
`--compare-torchrec VENV` runs `benchmarks/compare_torchrec.py` instead (`--steps`, `--warmup`,
`--repeats`, `--quick` passed on): recshard and TorchRec side by side, the ratio, the floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.ebc_kernels import bench_kernels
from benchmarks.ebc_workload import (
    LEARNING_RATE,
    QUICK,
    Sizes,
    balanced_ranks,
    batch_tensors,
    contiguous_ranks,
    pooling_factors,
    table_rows,
)
from benchmarks.link import (
    CollectiveWaitClock,
    add_link_argument,
    emit,
    relaunch_under_link,
)
from benchmarks.ranks import launched_ranks, minor_faults, run_ranks, timed_steps, warm_up
from benchmarks.step_profile import profile_steps
from recshard import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.calibration.procfs import rss_bytes
from recshard.comm import transport
from recshard.comm.codecs import get_qcomm_codecs_registry
from recshard.comm.pg import get_local_size
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    ShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from recshard.types import ShardingEnv

SHARDING_TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise"]
# name -> (sharding type, compute kernel); "<type>_dense" is the dense kernel + torch SGD.
# "table_wise_in_order" (diagnostic, not run by default) places tables on ranks in contiguous
# blocks, so the sharded output needs no column permutation back to module order. "planner"
# (not run by default): recshard's planner's plan for this topology (hosts from torchrun's
# LOCAL_WORLD_SIZE, `--inter-host-gbps`), fused kernels, the tables' pooling factors.
CONFIGS: Dict[str, Tuple[str, str]] = {
    **{t: (t, "fused") for t in SHARDING_TYPES},
    "data_parallel": ("data_parallel", "dense"),
    **{f"{t}_dense": (t, "dense") for t in SHARDING_TYPES},
    "table_wise_in_order": ("table_wise", "fused"),
    "planner": ("planner", "fused"),
    "table_wise_fp16": ("table_wise", "fused"),
    "table_wise_bf16": ("table_wise", "fused"),
    "table_wise_fp16_weights": ("table_wise", "fused"),
    "row_wise_fp16_weights": ("row_wise", "fused"),
}
# configurations whose pooled collectives send in a narrower dtype (comm codecs, both ways)
WIRE_PRECISION: Dict[str, str] = {"table_wise_fp16": "fp16", "table_wise_bf16": "bf16"}
# configurations whose tables hold FP16 weights (`data_type=DataType.FP16`; fp32 state, output)
FP16_WEIGHTS = {"table_wise_fp16_weights", "row_wise_fp16_weights"}
DEFAULT_TYPES = SHARDING_TYPES + ["data_parallel", "table_wise_dense"]
BASELINE = "table_wise"


# ----------------------------------------------------------------------------- work


def criteo_tables(sizes: Sizes) -> List[EmbeddingBagConfig]:
    """26 tables `t<i>`, each read by one feature `cat_<i>`, rows capped at `sizes.row_cap`."""
    return [
        EmbeddingBagConfig(
            num_embeddings=rows, embedding_dim=sizes.dim, name=f"t{i}", feature_names=[f"cat_{i}"]
        )
        for i, rows in enumerate(table_rows(sizes))
    ]


def make_batches(
    tables: List[EmbeddingBagConfig], pooling: List[int], batch: int, seed: int, count: int
) -> List[KeyedJaggedTensor]:
    """`count` KJTs of `batch` samples: table t's bags hold `pooling[t]` uniform ids."""
    keys = [f for t in tables for f in t.feature_names]
    return [
        KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, stride=batch)
        for values, lengths in batch_tensors(
            [t.num_embeddings for t in tables], pooling, batch, seed, count
        )
    ]


def per_table_plan(
    name: str,
    tables: List[EmbeddingBagConfig],
    pooling: List[int],
    world_size: int,
    local_size: int,
) -> Dict[str, ShardingGenerator]:
    """Table-wise: tables balanced over ranks; table-row-wise: over hosts (`local_size` ranks
    each), rows split within the host."""
    sharding_type, kernel = CONFIGS[name]
    placement = contiguous_ranks if name == "table_wise_in_order" else balanced_ranks
    ranks = placement(pooling, world_size)
    hosts = balanced_ranks(pooling, world_size // local_size)
    make: Dict[str, Callable[[int], ShardingGenerator]] = {
        "table_wise": lambda t: table_wise(ranks[t], compute_kernel=kernel),
        "row_wise": lambda t: row_wise(compute_kernel=kernel),
        "column_wise": lambda t: column_wise(list(range(world_size)), compute_kernel=kernel),
        "table_row_wise": lambda t: table_row_wise(hosts[t], compute_kernel=kernel),
        "data_parallel": lambda t: data_parallel(),
    }
    return {table.name: make[sharding_type](t) for t, table in enumerate(tables)}


@dataclass
class Trainee:
    """A sharded EBC and the dense optimizer its non-fused weights need (or None)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None


def planned(
    ebc: EmbeddingBagCollection,
    sharder: EmbeddingBagCollectionSharder,
    pooling: List[int],
    batch: int,
    inter_host_gbps: float | None,
) -> Any:
    """The planner's module plan for `ebc` on this group's topology (rank 0 plans)."""
    world_size = dist.get_world_size()
    topology = Topology(
        world_size,
        "cpu",
        local_world_size=get_local_size(world_size),
        inter_host_bw=None if inter_host_gbps is None else inter_host_gbps / 8,
    )
    constraints = {
        name: ParameterConstraints(compute_kernels=["fused"], pooling_factors=[float(p)])
        for name, p in zip(ebc.embedding_bags, pooling)
    }
    planner = EmbeddingShardingPlanner(topology, batch_size=batch, constraints=constraints)
    return planner.collective_plan(ebc, [sharder]).plan[""]


def build(
    name: str,
    tables: List[EmbeddingBagConfig],
    pooling: List[int],
    batch: int,
    inter_host_gbps: float | None,
) -> Trainee:
    if name in FP16_WEIGHTS:
        tables = [dataclasses.replace(t, data_type=DataType.FP16) for t in tables]
    ebc = EmbeddingBagCollection(tables, device="meta")  # shards initialize from the configs
    world_size = dist.get_world_size()
    local_size = get_local_size(world_size)
    precision = WIRE_PRECISION.get(name)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LEARNING_RATE},
        qcomm_codecs_registry=None if precision is None else get_qcomm_codecs_registry(precision),
    )
    if name == "planner":
        plan = planned(ebc, sharder, pooling, batch, inter_host_gbps)
    else:
        plan = construct_module_sharding_plan(
            ebc,
            per_table_plan(name, tables, pooling, world_size, local_size),
            local_size=local_size,
            world_size=world_size,
        )
    module = sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD))
    dense = [
        p
        for p in module.parameters()
        if p.requires_grad and not getattr(p, "_in_backward_optimizers", False)
    ]
    optimizer = torch.optim.SGD(dense, lr=LEARNING_RATE) if dense else None
    return Trainee(module, optimizer)


def train_step(trainee: Trainee, kjt: KeyedJaggedTensor) -> None:
    """Forward + backward (+ dense SGD step); fused kernels update inside backward."""
    pooled = trainee.module(kjt)
    pooled.values().sum().backward()
    if trainee.optimizer is not None:
        trainee.optimizer.step()
        trainee.optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- timing


def rss_mb() -> float:
    """This process's resident memory now, MiB."""
    return rss_bytes() / 2**20


def measure(name: str, sizes: Sizes, args: argparse.Namespace, profile: bool) -> Dict[str, object]:
    """One run of one configuration on this rank (inside a fresh process group): build it,
    `warmup` steps, then `steps` timed steps; with `profile`, the profiled steps instead.

    Returns this rank's step seconds and resident memory before / after the timed steps
    (a growing figure means memory kept across steps), and rank 0's profile record.
    """
    rank = dist.get_rank()
    tables = criteo_tables(sizes)
    pooling = pooling_factors(len(tables), sizes.max_pooling)
    batches = make_batches(tables, pooling, sizes.batch, seed=1 + rank, count=args.batches)
    trainee = build(name, tables, pooling, sizes.batch, args.inter_host_gbps)
    warm_up(lambda i: train_step(trainee, batches[i % len(batches)]), args.warmup)
    if profile:
        return {"profile": profile_steps(name, trainee, batches, args.profile_steps)}
    rss_start = rss_mb()
    waits = CollectiveWaitClock()
    faults = minor_faults()
    times = timed_steps(lambda i: train_step(trainee, batches[i % len(batches)]), args.steps)
    faults = minor_faults() - faults
    waits.close()
    return {
        "times": times,
        "waits": waits.take(),
        "faults_per_step": faults / args.steps,
        "rss_start_mb": rss_start,
        "rss_end_mb": rss_mb(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "transport_mb": transport.held_bytes(dist.group.WORLD) / 2**20,
    }


def bench_ebc(
    names: List[str], sizes: Sizes, args: argparse.Namespace, ranks: Callable[..., List[Any]]
) -> None:
    """Every configuration once per repeat (interleaved), each run by `ranks` (`run_ranks`:
    fresh processes; `launched_ranks`: torchrun's); one JSON line per configuration, then
    the profiles."""
    ws = args.world_size
    local_size = get_local_size(ws)
    tables = criteo_tables(sizes)
    pooling = pooling_factors(len(tables), sizes.max_pooling)
    emit(
        dict(
            bench="ebc_setup",
            world_size=ws,
            tables=len(tables),
            dim=sizes.dim,
            total_rows=sum(t.num_embeddings for t in tables),
            batch_per_rank=sizes.batch,
            pooling_factors=pooling,
            lookups_per_rank_batch=sum(pooling) * sizes.batch,
            table_wise_ranks=balanced_ranks(pooling, ws),
            table_wise_in_order_ranks=contiguous_ranks(pooling, ws),
            torch_threads_per_rank=args.threads,
            pinned=args.pin,
            hosts=ws // local_size,
            ranks_per_host=local_size,
            launcher="torchrun" if dist.is_initialized() else "forkserver",
        )
    )
    repeat_medians: Dict[str, List[float]] = {name: [] for name in names}
    growth: Dict[str, List[float]] = {name: [] for name in names}
    peak: Dict[str, float] = {name: 0.0 for name in names}
    transport_mb: Dict[str, List[float]] = {name: [0.0] * ws for name in names}
    wait_shares: Dict[str, List[Dict[str, float]]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            per_rank = ranks(ws, args, measure, name, sizes, args, False)
            slowest = [max(step) for step in zip(*(r["times"] for r in per_rank))]
            repeat_medians[name].append(statistics.median(slowest))
            growth[name].append(
                max((r["rss_end_mb"] - r["rss_start_mb"]) / args.steps for r in per_rank)
            )
            peak[name] = max([peak[name]] + [r["peak_rss_mb"] for r in per_rank])
            held = [r["transport_mb"] for r in per_rank]
            transport_mb[name] = [max(a, b) for a, b in zip(transport_mb[name], held)]
            wait_shares[name].append(per_rank[0]["waits"].shares(1e3 * sum(per_rank[0]["times"])))
    results = {name: statistics.median(m) for name, m in repeat_medians.items()}
    base = results.get(BASELINE)
    for name in names:
        sharding_type, kernel = CONFIGS[name]
        step_s = results[name]
        record = dict(
            bench="ebc_step",
            name=name,
            sharding_type=sharding_type,
            compute_kernel=kernel,
            world_size=ws,
            batch=sizes.batch,
            steps=args.steps,
            repeats=args.repeats,
            median_step_ms=round(1e3 * step_s, 2),
            samples_per_s=round(ws * sizes.batch / step_s),
            repeat_medians_ms=[round(1e3 * m, 2) for m in repeat_medians[name]],
            rss_growth_mb_per_step=round(statistics.median(growth[name]), 2),
            peak_rss_mb=round(peak[name]),
            transport_mb_per_rank=[round(m, 1) for m in transport_mb[name]],
            wait_share={
                k: statistics.median(s[k] for s in wait_shares[name]) for k in wait_shares[name][0]
            },
        )
        if base is not None:
            record["step_ms_vs_table_wise"] = round(step_s / base, 3)
            record["samples_per_s_vs_table_wise"] = round(base / step_s, 3)
        emit(record)
    for name in args.profile or ([BASELINE] if BASELINE in names else names[:1]):
        emit(ranks(ws, args, measure, name, sizes, args, True)[0]["profile"])


# ----------------------------------------------------------------------------- entry


def _parse_types(text: str) -> List[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {unknown or text!r}; choose from {', '.join(CONFIGS)}"
        )
    return names


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (3)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs (3)")
    parser.add_argument(
        "--types",
        type=_parse_types,
        default=list(DEFAULT_TYPES),
        help=f"comma-separated configurations, default {','.join(DEFAULT_TYPES)}; "
        f"any of {', '.join(CONFIGS)}",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--pin", action="store_true", help="pin rank r to the r-th allowed CPU")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled")
    parser.add_argument(
        "--profile",
        type=_parse_types,
        default=None,
        help="configurations to profile on rank 0 (default table_wise)",
    )
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel comparison")
    parser.add_argument(
        "--kernel-threads",
        type=lambda text: [int(n) for n in text.split(",")],
        default=sorted({1, torch.get_num_threads()}),
        help="torch thread counts for the kernel comparison (default: 1 and torch's default)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument(
        "--inter-host-gbps",
        type=float,
        default=None,
        help="the planner configuration's inter-host bandwidth, Gbit/s "
        "(default: the planner's, 25 GbE)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps (smoke test)")
    parser.add_argument(
        "--compare-torchrec",
        metavar="VENV",
        default=None,
        help="run benchmarks.compare_torchrec with this TorchRec venv instead",
    )
    add_link_argument(parser)
    args = parser.parse_args(argv)
    defaults = (2, 1, 1) if args.quick else (30, 3, 3)
    for attr, default in zip(("steps", "warmup", "repeats"), defaults):
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    if args.quick:
        args.profile_steps = min(args.profile_steps, 1)
        args.batches = min(args.batches, 2)
    return args


def compare_torchrec(args: argparse.Namespace) -> None:
    """`python -m benchmarks.compare_torchrec --venv VENV` with this run's step counts."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.compare_torchrec",
        "--venv",
        args.compare_torchrec,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        *(["--quick"] if args.quick else []),
    ]
    status = subprocess.run(command, cwd=Path(__file__).resolve().parents[1]).returncode
    if status:
        raise SystemExit(status)


def cli(argv: List[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare_torchrec is not None:
        compare_torchrec(args)
        return
    if relaunch_under_link("benchmarks.ebc", args.link, argv):
        return
    sizes = QUICK if args.quick else Sizes()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun started this process as one rank
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        torch.set_num_threads(args.threads)
        args.world_size = dist.get_world_size()
        try:
            bench_ebc(args.types, sizes, args, launched_ranks)
        finally:
            dist.destroy_process_group()
        return
    if not args.no_kernels:  # in this process, before any rank starts
        for threads in args.kernel_threads:
            torch.set_num_threads(threads)
            bench_kernels(sizes, args)
    bench_ebc(args.types, sizes, args, run_ranks)


if __name__ == "__main__":
    cli()
