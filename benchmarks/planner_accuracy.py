"""Planner accuracy: the planner's predicted step time and memory vs measured, per plan.

    python -m benchmarks.planner_accuracy               # full run, 2 gloo ranks (~5 min)
    python -m benchmarks.planner_accuracy --quick       # tiny sizes (smoke test)
    python -m benchmarks.planner_accuracy --dims 128 --profile p.json   # a part, a saved profile
    python -m benchmarks.planner_accuracy --workloads d64_zipf_b2048,d16_uniform_b512
    python -m benchmarks.planner_accuracy --no-calibration   # built-in costs (out of the box)
    python -m benchmarks.planner_accuracy --forced table_wise,column_wise --repeats 6  # a subset
    python -m benchmarks.planner_accuracy --link 1gbit \\
        --local-world-size 1 --link-check fast_profile.json   # item 4 on 1-rank hosts
                                                              # (2 x 2 ranks: planner_link)
    python -m scripts.cluster --hosts 2 -- .venv/bin/torchrun --nnodes 2 --nproc_per_node 2 \\
        --rdzv-backend c10d --rdzv-endpoint host0:29500 -m benchmarks.planner_accuracy ...

Under torchrun (above: 2 hosts x 2 ranks, `scripts.cluster`) the layout is the launched job's
and every run's ranks are still fresh processes, each started by its launched rank on that
rank's host (`benchmarks.ranks.launched_fresh_ranks`); rank 0 prints.

First a calibration profile is measured on the same ranks (as `calibrate_job`: kernels, links
among the ranks, a sharded module's step overhead per sharding type), or read with `--profile`;
`--no-calibration` plans and estimates with the planner's built-in costs instead, as a user who
never ran `recshard-plan calibrate` gets (the planner-vs-fastest check is what matters there:
the built-in costs are bytes at nominal bandwidths, not this machine's times).
Workloads: the 26 Criteo-like tables of `benchmarks.ebc` (Kaggle sizes capped at `--row-cap` rows),
one feature each with a fixed pooling factor 1-20 (seed 0), at dims 16, 64 and 128, uniform or
Zipf(1.05) ids, per-rank batch 512 and 2048. Each table's `CacheParams.stats`
(`SampledCacheStatistics`: distinct rows per global batch, measured on `--stats-samples` sampled
global batches of the workload's own id generator) goes to the planner and to every forced plan's
estimate, as TorchRec users pass what they measured on their data (`--stats-samples 0`: no stats,
ids priced as uniform). Plans: each sharding type forced on every table (fused kernel;
data-parallel: dense; `--forced`: only these types, the fastest forced plan then among them),
placed by the planner, and the planner's own plan (`"plan":
"planner"`); with `--link-check P`, also the planner's plan under profile P's costs.
Each plan runs in fresh rank processes: `--warmup` steps, then `--steps` timed steps of
forward + backward + update (exact SGD); `measured_ms` is the median over steps of the slowest
rank's step (`measured_fwd_ms`: of its forward); with `--repeats N`, each plan runs in N fresh
sets of rank processes, taking turns with the workload's other plans (a spell of a slow machine
then lands on all of them, not on one plan's every run), and `measured_ms` is the median of
their N medians (`measured_repeats_ms`). Time is measured under the allocator settings `make
demo` launches with, memory in one more set of rank processes under a fixed mmap threshold
(`benchmarks/allocator.py`: the benchmark sets both itself). A plan identical to one already
run in the workload (the planner's plan is often all table-wise) is not run again: it carries
that run's figures and `"same_as": LABEL` (running it twice would only sample the noise).
`predicted_terms_ms` splits the slowest rank's estimate into forward / backward compute and
communication; `predicted_fixed_ms` is the per-step cost of the plan's sharding groups.
`predicted_ms` is `plan_stats(...).predicted_step_ms`; memory: the estimate's largest rank vs
the largest per-rank growth of peak RSS from before building the module (after a first dense
optimizer step on a scalar: torch.optim's lazy imports are the process's, not the plan's)
(`memory_build_mb`: the growth once built, before any step; `memory_stored_mb`: the plan's
weights and optimizer state on its fullest rank).
Every line on stdout is one JSON object; the last one checks the targets of issue #22.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from benchmarks.allocator import Allocator, set_allocator
from benchmarks.ebc import Trainee, emit, rss_mb, train_step
from benchmarks.ebc_workload import LEARNING_RATE
from benchmarks.link import relaunch_under_link
from benchmarks.planner_accuracy_args import FORCED, parse_args
from benchmarks.planner_workloads import (
    Workload,
    configs,
    make_batches,
    metas,
    sampled_cache_params,
)
from benchmarks.ranks import launched_fresh_ranks, run_ranks
from recshard import EmbeddingBagCollection
from recshard.calibration import CalibrationGrid, StepProbe, calibrate_job
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from recshard.planner.cost.plan_stats import plan_stats
from recshard.planner.plan_io import plan_to_dict
from recshard.planner.profile import CalibrationProfile
from recshard.types import ShardingEnv, ShardingPlan

MIN_PARTITION = 8  # column-wise shards as narrow as 8 (dim 16 splits in two)
TARGETS = {
    "median_rel_error": 0.20,
    "worst_rel_error": 0.35,
    "planner_vs_fastest": 1.05,
    "memory_rel_error": 0.15,
}


# ----------------------------------------------------------------------------- on the ranks


def rank_calibrate(args: argparse.Namespace) -> Dict[str, Any]:
    """`calibrate_job` on this rank (every rank gets rank 0's fits); the profile as a dict.
    Under the timing runs' allocator, as a job calibrates under the settings it trains with:
    where each step's table-sized gradient is mmapped and page-faulted anew, the dense
    kernel's update of a whole table cost 1.7-1.9e-6 ms an element at dim 128, 0.5e-6 without."""
    set_allocator(Allocator.TIMING)
    grid = CalibrationGrid.quick() if args.quick else CalibrationGrid()
    return calibrate_job(
        args.calibration_budget,
        grid,
        local_world_size=args.local_world_size,
        probe=StepProbe.quick() if args.quick else None,
    ).to_dict()


def warm_dense_optimizer() -> None:
    """One SGD step on a scalar: the first torch.optim optimizer of a process imports its
    lazy modules (~30 MB resident), a one-time cost of any job with a dense part, not of the
    plan (only the data-parallel plans here have dense parameters)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=LEARNING_RATE)
    param.sum().backward()
    optimizer.step()


def rank_measure(
    plan: ShardingPlan, w: Workload, args: argparse.Namespace, allocator: Allocator
) -> Dict[str, Any]:
    """Build the plan's sharded EBC, warm up, time `steps` steps; RSS before and peak."""
    set_allocator(allocator)
    rank = dist.get_rank()
    batches = make_batches(w, args.row_cap, args.max_pooling, 1 + rank, args.batches)
    warm_dense_optimizer()
    rss_before = rss_mb()
    ebc = EmbeddingBagCollection(configs(w, args.row_cap), device="meta")
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LEARNING_RATE}
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD, args.local_world_size)
    module = sharder.shard(ebc, plan.plan[""], env)
    dense = [
        p
        for p in module.parameters()
        if p.requires_grad and not getattr(p, "_in_backward_optimizers", False)
    ]
    trainee = Trainee(module, torch.optim.SGD(dense, lr=LEARNING_RATE) if dense else None)
    built = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rss_mb())
    for i in range(args.warmup):
        train_step(trainee, batches[i % len(batches)])
    dist.barrier()
    times, forwards = [], []
    for i in range(args.steps):
        start = time.perf_counter()
        pooled = trainee.module(batches[i % len(batches)])
        forwards.append(time.perf_counter() - start)
        pooled.values().sum().backward()
        if trainee.optimizer is not None:
            trainee.optimizer.step()
            trainee.optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "times": times,
        "forwards": forwards,
        "build_growth_mb": built - rss_before,
        "rss_growth_mb": max(peak, rss_mb()) - rss_before,
    }


# ----------------------------------------------------------------------------- driver


def plans_for(
    w: Workload,
    profile: CalibrationProfile | None,
    args: argparse.Namespace,
    link_check: CalibrationProfile | None,
) -> List[Tuple[str, ShardingPlan]]:
    tables = metas(w, args.row_cap, args.max_pooling)
    topology = _topology(profile, args)
    cache = sampled_cache_params(w, args) if args.stats_samples else {}
    out = []
    for st in args.forced:
        kernel = ["dense"] if st == "data_parallel" else ["fused"]
        forced = {
            t.name: ParameterConstraints(
                sharding_types=[st],
                compute_kernels=kernel,
                min_partition=MIN_PARTITION,
                cache_params=cache.get(t.name),
            )
            for t in tables
        }
        out.append(
            (
                st,
                EmbeddingShardingPlanner(
                    topology, w.batch, constraints=forced, debug=False
                ).plan_tables(tables),
            )
        )
    own = {
        t.name: ParameterConstraints(min_partition=MIN_PARTITION, cache_params=cache.get(t.name))
        for t in tables
    }
    out.append(
        (
            "planner",
            EmbeddingShardingPlanner(topology, w.batch, constraints=own, debug=False).plan_tables(
                tables
            ),
        )
    )
    if link_check is not None:
        other = EmbeddingShardingPlanner(
            _topology(link_check, args), w.batch, constraints=own, debug=False
        )
        out.append(("planner@" + args.link_check, other.plan_tables(tables)))
    return out


def _topology(profile: CalibrationProfile | None, args: argparse.Namespace) -> Topology:
    return Topology(args.world_size, local_world_size=args.local_world_size, profile=profile)


def _types(plan: ShardingPlan) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for ps in plan.plan[""].values():
        counts[ps.sharding_type] = counts.get(ps.sharding_type, 0) + 1
    return counts


def _median_slowest(per_rank: List[Dict[str, Any]], key: str) -> float:
    """Median over steps of the slowest rank's `key` times, in ms."""
    return 1e3 * statistics.median(max(step) for step in zip(*(r[key] for r in per_rank)))


def run_workload(
    w: Workload,
    profile: CalibrationProfile | None,
    args: argparse.Namespace,
    link_check: CalibrationProfile | None,
    ranks: Callable[..., List[Any]] = run_ranks,
) -> List[Dict[str, Any]]:
    tables = metas(w, args.row_cap, args.max_pooling)
    topology = _topology(profile, args)
    labelled = plans_for(w, profile, args, link_check)
    keys = [json.dumps(plan_to_dict(plan)["modules"], sort_keys=True) for _, plan in labelled]
    first: Dict[str, int] = {}  # plan JSON -> index of its first label
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    runs: Dict[str, List[List[Dict[str, Any]]]] = {key: [] for key in first}

    def measure(i: int, allocator: Allocator) -> List[Dict[str, Any]]:
        return ranks(
            args.world_size,
            args,
            rank_measure,
            labelled[i][1],
            w,
            args,
            allocator,
            local_world_size=args.local_world_size,
        )

    for _ in range(args.repeats):  # round robin: a slow spell of the machine hits every plan
        for key, i in first.items():
            runs[key].append(measure(i, Allocator.TIMING))
    memory = {key: measure(i, Allocator.MEMORY) for key, i in first.items()}
    records = []
    for (label, plan), key in zip(labelled, keys):
        stats = plan_stats(plan, tables, topology, w.batch)
        same_as = labelled[first[key]][0] if labelled[first[key]][0] != label else None
        repeats, per_rank = runs[key], memory[key]
        each = [_median_slowest(r, "times") for r in repeats]
        measured = statistics.median(each)
        forward = statistics.median(_median_slowest(r, "forwards") for r in repeats)
        mem_est = stats.max("memory") / 2**20
        mem_meas = max(r["rss_growth_mb"] for r in per_rank)
        terms = max(stats.ranks, key=lambda r: r.total_ms).terms
        record = dict(
            bench="planner_accuracy",
            workload=w.name,
            plan=label,
            sharding_types=_types(plan),
            predicted_ms=round(stats.predicted_step_ms, 3),
            measured_ms=round(measured, 3),
            rel_error=round(abs(stats.predicted_step_ms - measured) / measured, 4),
            predicted_terms_ms={k: round(v, 3) for k, v in asdict(terms).items()},
            predicted_fixed_ms=round(stats.fixed_ms, 3),
            measured_fwd_ms=round(forward, 3),
            memory_estimate_mb=round(mem_est, 1),
            memory_measured_mb=round(mem_meas, 1),
            memory_build_mb=round(max(r["build_growth_mb"] for r in per_rank), 1),
            memory_stored_mb=round(stats.max("bytes_stored") / 2**20, 1),
            memory_rel_error=round(abs(mem_est - mem_meas) / max(mem_meas, 1e-9), 4),
        )
        if args.repeats > 1:
            record["measured_repeats_ms"] = [round(ms, 3) for ms in each]
        if same_as is not None:
            record["same_as"] = same_as
        emit(record)
        records.append(record)
    forced = [r for r in records if r["plan"] in FORCED]
    fastest = min(forced, key=lambda r: r["measured_ms"])
    own = next(r for r in records if r["plan"] == "planner")
    summary = dict(
        bench="planner_accuracy_workload",
        workload=w.name,
        fastest_forced=fastest["plan"],
        fastest_forced_ms=fastest["measured_ms"],
        planner_ms=own["measured_ms"],
        planner_vs_fastest=round(own["measured_ms"] / fastest["measured_ms"], 3),
    )
    other = next((r for r in records if r["plan"].startswith("planner@")), None)
    if other is not None:
        summary["link_check_vs_planner"] = round(other["measured_ms"] / own["measured_ms"], 3)
    emit(summary)
    return records


def summarize(records: List[Dict[str, Any]], workloads: List[Workload]) -> Dict[str, Any]:
    errors = [r["rel_error"] for r in records]
    mem = [r["memory_rel_error"] for r in records]
    ratios = []
    for w in workloads:
        mine = [r for r in records if r["workload"] == w.name]
        fastest = min(r["measured_ms"] for r in mine if r["plan"] in FORCED)
        ratios.append(next(r["measured_ms"] for r in mine if r["plan"] == "planner") / fastest)
    result = dict(
        median_rel_error=statistics.median(errors),
        worst_rel_error=max(errors),
        planner_vs_fastest=max(ratios),
        memory_rel_error=max(mem),
    )
    met = {k: result[k] <= TARGETS[k] for k in TARGETS}
    return dict(
        bench="planner_accuracy_summary",
        runs=len(records),
        **{k: round(v, 4) for k, v in result.items()},
        targets=TARGETS,
        met=met,
    )


def cli(argv: List[str] | None = None) -> None:
    args = parse_args(argv)
    if relaunch_under_link("benchmarks.planner_accuracy", args.link, argv):
        return
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun started this process as one rank
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        args.world_size = dist.get_world_size()
        args.local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
        try:
            run(args, launched_fresh_ranks)
        finally:
            dist.destroy_process_group()
    else:
        run(args, run_ranks)


def run(args: argparse.Namespace, ranks: Callable[..., List[Any]]) -> None:
    """Calibrate (or load the profile, or neither: `--no-calibration`), then every workload's
    plans, each in fresh rank processes started by `ranks` (`run_ranks` here,
    `launched_fresh_ranks` under torchrun)."""
    start = time.perf_counter()
    profile: CalibrationProfile | None = None
    if args.profile:
        profile = CalibrationProfile.load(args.profile)
    elif not args.no_calibration:
        profile = CalibrationProfile.from_dict(
            ranks(
                args.world_size, args, rank_calibrate, args, local_world_size=args.local_world_size
            )[0]
        )
    if (
        profile is not None
        and args.save_profile
        and (not dist.is_initialized() or dist.get_rank() == 0)
    ):
        profile.save(args.save_profile)
    link_check = CalibrationProfile.load(args.link_check) if args.link_check else None
    emit(
        dict(
            bench="planner_accuracy_setup",
            world_size=args.world_size,
            local_world_size=args.local_world_size,
            threads=args.threads,
            row_cap=args.row_cap,
            steps=args.steps,
            calibration_s=None if profile is None else round(profile.seconds, 1),
            links={
                f"{c.collective}/{c.level}": [round(c.gbps, 3), round(c.latency_ms, 4)]
                for c in (profile.links if profile is not None else [])
            },
        )
    )
    workloads = [
        Workload(int(d), ids, int(b))
        for d in args.dims.split(",")
        for ids in args.ids.split(",")
        for b in args.batches_per_rank.split(",")
    ]
    if args.workloads:
        names = args.workloads.split(",")
        unknown = sorted(set(names) - {w.name for w in workloads})
        if unknown:
            raise SystemExit(
                f"--workloads: no workload named {unknown} among {[w.name for w in workloads]}"
            )
        workloads = [w for w in workloads if w.name in names]
    records: List[Dict[str, Any]] = []
    for w in workloads:
        records += run_workload(w, profile, args, link_check, ranks)
    summary = summarize(records, workloads)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    emit(summary)


if __name__ == "__main__":
    cli()
