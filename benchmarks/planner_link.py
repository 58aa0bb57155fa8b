"""Issue #22 item 4 on a real multi-host job: does the plan made for a slow inter-host link
measure faster on that link than the plan made for a fast one?

    python -m scripts.cluster --hosts 2 --rate 1gbit --burst 512kb -- .venv/bin/torchrun \\
        --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        -m benchmarks.planner_link

(`--burst 512kb`: with the cluster's default 4 MB tbf bucket a step's few-MB bursts cross the
1gbit link at full speed.) Every rank runs `calibrate_job` (kernels, the intra- and inter-host
links as shaped, the step costs; one profile for the job). Two plans of the same tables:
`slow_link`, planned with that profile; `fast_link`, planned with the same profile but the
inter-host links priced as the intra-host ones (what the planner would measure on a fast
network). Workload: one large pooled table (`--rows` x `--dim`, `--pooling` uniform ids per
bag) and one small one, per-rank batch `--batch`; the large table is split by rows (`--types`,
default row-wise or table-row-wise: the question is where its partial sums are reduced;
unconstrained, the planner splits it by columns inside a host, table-column-wise, under both
profiles). Each allowed type is also run forced (`row_wise`, `table_row_wise`); a plan equal
to one already run is not run again (`same_as`). The plans are built in the same processes
and timed in alternating blocks (forward + backward + update, exact SGD); `measured_ms` is the
median over steps of the slowest rank's step, `predicted_ms` the plan's estimate under the
measured (slow) profile, `predicted_fast_ms` under the fast one. Rank 0 prints JSON lines.
4 ranks on this machine's 2 cores are contended by nature: the planner prices each rank as
having a core of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from benchmarks.ebc import Trainee, train_step
from benchmarks.ebc_workload import LEARNING_RATE
from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.calibration import CalibrationGrid, calibrate_job
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, TableMeta, Topology
from recshard.planner.cost.plan_stats import plan_stats
from recshard.planner.plan_io import plan_to_dict
from recshard.planner.profile import CalibrationProfile
from recshard.types import ShardingEnv, ShardingPlan


def tables(args: argparse.Namespace) -> List[TableMeta]:
    return [
        TableMeta(
            "big",
            args.rows,
            args.dim,
            ["f_big"],
            pooling_factors=[float(args.pooling)],
            optimizer="exact_sgd",
        ),
        TableMeta("small", 1000, 16, ["f_small"], pooling_factors=[1.0], optimizer="exact_sgd"),
    ]


def fast_profile(profile: CalibrationProfile) -> CalibrationProfile:
    """`profile` with every inter-host link fit replaced by the same collective's intra-host
    one: the planner told the network between hosts is as fast as inside a host."""
    intra = {c.collective: c for c in profile.links if c.level == "intra"}
    links = [
        dataclasses.replace(intra[c.collective], level="inter", ranks=c.ranks)
        if c.level == "inter" and c.collective in intra
        else c
        for c in profile.links
    ]
    return dataclasses.replace(profile, links=links)


def _plan(
    profile: CalibrationProfile, world: int, local: int, args: argparse.Namespace, types: str
) -> ShardingPlan:
    topology = Topology(world, local_world_size=local, profile=profile)
    constraints = {"big": ParameterConstraints(sharding_types=types.split(","))} if types else None
    return EmbeddingShardingPlanner(
        topology, args.batch, constraints=constraints, debug=False
    ).plan_tables(tables(args))


def _batch(args: argparse.Namespace, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.cat(
        [
            torch.randint(0, args.rows, (args.batch * args.pooling,), generator=g),
            torch.randint(0, 1000, (args.batch,), generator=g),
        ]
    )
    lengths = torch.tensor([args.pooling, 1], dtype=torch.int32).repeat_interleave(args.batch)
    return KeyedJaggedTensor.from_lengths_sync(
        ["f_big", "f_small"], values, lengths, stride=args.batch
    )


def _trainee(plan: ShardingPlan, args: argparse.Namespace, local: int) -> Trainee:
    configs = [
        EmbeddingBagConfig(
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            name=t.name,
            feature_names=list(t.feature_names),
        )
        for t in tables(args)
    ]
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LEARNING_RATE}
    )
    module = sharder.shard(
        EmbeddingBagCollection(configs, device="meta"),
        plan.plan[""],
        ShardingEnv.from_process_group(dist.group.WORLD, local),
    )
    dense = [
        p
        for p in module.parameters()
        if p.requires_grad and not getattr(p, "_in_backward_optimizers", False)
    ]
    return Trainee(module, torch.optim.SGD(dense, lr=LEARNING_RATE) if dense else None)


def _types(plan: ShardingPlan) -> Dict[str, str]:
    return {name: ps.sharding_type for name, ps in plan.plan[""].items()}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--pooling", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048, help="per rank")
    parser.add_argument(
        "--types",
        default="row_wise,table_row_wise",
        help="sharding types allowed for the large table ('' = any)",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--blocks", type=int, default=3, help="alternating blocks per plan")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--calibration-budget", type=float, default=20.0)
    parser.add_argument("--profile", default=None, help="use this profile, do not calibrate")
    parser.add_argument("--save-profile", default=None)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    start = time.perf_counter()
    if args.profile:
        profile = CalibrationProfile.load(args.profile)
    else:
        profile = calibrate_job(args.calibration_budget, CalibrationGrid(), local_world_size=local)
    if rank == 0 and args.save_profile:
        profile.save(args.save_profile)
    fast = fast_profile(profile)
    candidates = {
        "slow_link": _plan(profile, world, local, args, args.types),
        "fast_link": _plan(fast, world, local, args, args.types),
    }
    for forced in args.types.split(",") if args.types else []:
        candidates[forced] = _plan(profile, world, local, args, forced)
    plans: Dict[str, ShardingPlan] = {}  # each distinct plan once
    same_as: Dict[str, str] = {}
    for label, plan in candidates.items():
        key = json.dumps(plan_to_dict(plan)["modules"], sort_keys=True)
        first = next(
            (
                k
                for k, p in plans.items()
                if json.dumps(plan_to_dict(p)["modules"], sort_keys=True) == key
            ),
            None,
        )
        if first is None:
            plans[label] = plan
        else:
            same_as[label] = first
    slow_topology = Topology(world, local_world_size=local, profile=profile)
    fast_topology = Topology(world, local_world_size=local, profile=fast)
    trainees = {label: _trainee(plan, args, local) for label, plan in plans.items()}
    batches = [_batch(args, 100 * rank + i) for i in range(2)]
    times: Dict[str, List[float]] = {label: [] for label in plans}
    for _ in range(args.blocks):
        for label, trainee in trainees.items():
            for i in range(args.warmup):
                train_step(trainee, batches[i % 2])
            for i in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                train_step(trainee, batches[i % 2])
                times[label].append(time.perf_counter() - t0)
    gathered: List[Dict[str, List[float]] | None] = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        print(
            json.dumps(
                dict(
                    bench="planner_link_setup",
                    world_size=world,
                    local_world_size=local,
                    calibration_s=round(profile.seconds, 1),
                    links={
                        f"{c.collective}/{c.level}": [round(c.gbps, 3), round(c.latency_ms, 3)]
                        for c in profile.links
                    },
                )
            ),
            flush=True,
        )
        measured = {}
        for label, plan in candidates.items():
            run = same_as.get(label, label)
            slowest = [max(step) for step in zip(*(g[run] for g in gathered))]
            measured[label] = 1e3 * statistics.median(slowest)
            print(
                json.dumps(
                    dict(
                        bench="planner_link",
                        plan=label,
                        same_as=same_as.get(label),
                        sharding_types=_types(plan),
                        predicted_ms=round(
                            plan_stats(
                                plan, tables(args), slow_topology, args.batch
                            ).predicted_step_ms,
                            2,
                        ),
                        predicted_fast_ms=round(
                            plan_stats(
                                plan, tables(args), fast_topology, args.batch
                            ).predicted_step_ms,
                            2,
                        ),
                        measured_ms=round(measured[label], 2),
                        steps=len(slowest),
                    )
                ),
                flush=True,
            )
        print(
            json.dumps(
                dict(
                    bench="planner_link_summary",
                    same_plan=same_as.get("fast_link") == "slow_link",
                    fast_over_slow=round(measured["fast_link"] / measured["slow_link"], 3),
                    seconds=round(time.perf_counter() - start, 1),
                )
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
