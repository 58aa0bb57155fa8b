"""recshard against TorchRec on the whole DLRM training step, side by side in one run.

    python -m benchmarks.dlrm_compare --venv /tmp/torchrec-venv
    python -m benchmarks.dlrm_compare --venv V --plans planner --loops pipeline --profile
    python -m benchmarks.dlrm_compare --no-torchrec --quick          # recshard's side alone

The model users train (`benchmarks/dlrm_workload.py`): recshard's `models.dlrm.DLRMTrain` and
TorchRec's (`benchmarks/torchrec_dlrm.py.txt`, served by VENV's python in a subprocess:
TorchRec is no dependency of the project), 26 Criteo-like tables (dim 64, 1.48 M rows), fused
row-wise Adagrad on the tables, dense Adagrad on the arches under DDP, per-rank batch 2048, 2
ranks pinned one core each. Cases: each library's planner's plan (told the pooling factors,
nothing else), every table table-wise (the same balanced placement on both sides) and every
table row-wise, each through the plain loop and `TrainPipelineSparseDist`. Case by case,
recshard's ranks, then TorchRec's, all cases `--repeats` times (A B A B A B), fresh rank
processes each run. A run's figure is the median over steps of the slowest rank's step; the
reported one the median over repeats. Beside it, each rank's CPU time per step (all its
threads; median over repeats): wall time above the slowest rank's CPU time is time a rank
waited, for a peer in a collective or for its core (the load), not work.

Run it in the environment a user has: the rank processes inherit this one's, and a line
`environment` lists every MALLOC_* / RECSHARD_* variable that was set (none, for the figures
that count). Every line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from benchmarks.compare_torchrec import TorchRecServer, emit
from benchmarks.dlrm_workload import (
    DATA_TYPES,
    EPS,
    LEARNING_RATE,
    LOOPS,
    NUM_DENSE,
    PLANS,
    Arch,
    arch,
    measure,
)
from benchmarks.ebc_workload import balanced_ranks, copy_bandwidth_gbs
from benchmarks.ranks import rank_cpus, run_ranks
from recshard import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.datasets.utils import Batch
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from recshard.distributed.train_pipeline import TrainPipelineSparseDist
from recshard.models.dlrm import DLRM, DLRMTrain
from recshard.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from recshard.types import ShardingPlan

TORCHREC_SIDE = Path(__file__).with_name("torchrec_dlrm.py.txt")
EBC_PATH = "model.sparse_arch.embedding_bag_collection"
ENV_PREFIXES = ("MALLOC_", "RECSHARD_", "GLIBC_TUNABLES")


def make_batch(
    dense: torch.Tensor,
    keys: List[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    labels: torch.Tensor,
) -> Batch:
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, stride=dense.shape[0])
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def build(plan_name: str, a: Arch) -> Tuple[Any, Any, Any, List[str]]:
    """recshard's sharded DLRMTrain, its optimizers, pipeline class and sharding types."""
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            num_embeddings=n,
            embedding_dim=a.sizes.dim,
            name=f"t{i}",
            feature_names=[f"cat_{i}"],
            data_type=DataType[a.data_type],
        )
        for i, n in enumerate(a.rows)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=NUM_DENSE,
            dense_arch_layer_sizes=a.dense_arch,
            over_arch_layer_sizes=a.over_arch,
            dense_device=torch.device("meta"),
        )
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": "exact_row_wise_adagrad",
            "learning_rate": LEARNING_RATE,
            "eps": EPS,
        }
    )
    ws = dist.get_world_size()
    if plan_name == "planner":
        constraints = {
            t.name: ParameterConstraints(pooling_factors=[float(p)])
            for t, p in zip(tables, a.pooling)
        }
        planner = EmbeddingShardingPlanner(
            Topology(ws, "cpu", local_world_size=ws),
            batch_size=a.sizes.batch,
            constraints=constraints,
        )
        plan = planner.collective_plan(model, [sharder])
    else:
        ranks = balanced_ranks(a.pooling, ws)
        make = {
            "table_wise": lambda t: table_wise(rank=ranks[t], compute_kernel="fused"),
            "row_wise": lambda t: row_wise(compute_kernel="fused"),
        }[plan_name]
        module_plan = construct_module_sharding_plan(
            ebc, {t.name: make(i) for i, t in enumerate(tables)}, local_size=ws, world_size=ws
        )
        plan = ShardingPlan(plan={EBC_PATH: module_plan})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=LEARNING_RATE, eps=EPS),
    )
    kinds = sorted({s.sharding_type for s in plan.plan[EBC_PATH].values()})
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), TrainPipelineSparseDist, kinds


def recshard_side(request: Dict[str, Any]) -> Dict[str, Any]:
    return measure(request, make_batch, build)


def environment() -> Dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}


def _request(
    plan: str, loop: str, data_type: str, args: argparse.Namespace, profile: bool
) -> Dict[str, Any]:
    return dict(
        plan=plan,
        loop=loop,
        data_type=data_type,
        world_size=args.world_size,
        threads=1,
        pin=True,
        timeout=args.timeout,
        steps=args.steps,
        warmup=args.warmup,
        batches=args.batches,
        quick=args.quick,
        profile=profile,
        profile_steps=args.profile_steps,
        top=args.top,
    )


def _run_mine(request: Dict[str, Any]) -> List[Dict[str, Any]]:
    ns = argparse.Namespace(threads=1, pin=True, timeout=request["timeout"])
    return run_ranks(request["world_size"], ns, recshard_side, request)


def _slowest_median(per_rank: List[Dict[str, Any]]) -> float:
    return statistics.median(max(step) for step in zip(*(r["times"] for r in per_rank)))


def compare(args: argparse.Namespace) -> None:
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(rank_cpus(0, 1)))
    bandwidth = copy_bandwidth_gbs()
    os.sched_setaffinity(0, allowed)
    cases = [(p, lp, d) for p in args.plans for lp in args.loops for d in args.data_types]
    emit(
        dict(
            bench="dlrm_compare_setup",
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join([sys.executable, "-m", "benchmarks.dlrm_compare", *args.argv]),
            environment=environment(),
            load_average=os.getloadavg(),
            cpus=len(allowed),
            copy_bandwidth_gbs_per_core=round(bandwidth, 2),
            world_size=args.world_size,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            torchrec_venv=None if args.venv is None else str(args.venv),
        )
    )
    server = None if args.venv is None else TorchRecServer(args.venv, TORCHREC_SIDE)
    sides = ["recshard"] + ([] if server is None else ["torchrec"])
    runs: Dict[Tuple[str, str, str], Dict[str, List[Dict[str, Any]]]] = {
        c: {s: [] for s in sides} for c in cases
    }
    try:
        for _ in range(1 if args.profile else args.repeats):
            for plan, loop, data_type in cases:
                request = _request(plan, loop, data_type, args, args.profile)
                results = {"recshard": _run_mine(request)}
                if server is not None:
                    results["torchrec"] = server.run(request)
                for side, ranks in results.items():
                    if args.profile:
                        emit(
                            dict(
                                bench="dlrm_profile",
                                library=side,
                                plan=plan,
                                loop=loop,
                                data_type=data_type,
                                **ranks[0]["profile"],
                            )
                        )
                        continue
                    run = dict(
                        step=_slowest_median(ranks),
                        cpu_ms=[r["cpu_ms_per_step"] for r in ranks],
                        faults=max(r["faults_per_step"] for r in ranks),
                        rss=max(r["peak_rss_mb"] for r in ranks),
                        kinds=ranks[0]["sharding_types"],
                    )
                    runs[(plan, loop, data_type)][side].append(run)
                    emit(
                        dict(
                            bench="dlrm_run",
                            library=side,
                            plan=plan,
                            loop=loop,
                            data_type=data_type,
                            **run,
                        )
                    )
    finally:
        if server is not None:
            server.close()
    if args.profile:
        return
    batch = args.batch_per_rank * args.world_size
    for (plan, loop, data_type), by_side in runs.items():
        record: Dict[str, Any] = dict(
            bench="dlrm_compare", plan=plan, loop=loop, data_type=data_type
        )
        medians = {}
        for side, rs in by_side.items():
            medians[side] = statistics.median(r["step"] for r in rs)
            record[f"{side}_step_ms"] = round(1e3 * medians[side], 2)
            record[f"{side}_samples_per_s"] = round(batch / medians[side])
            record[f"{side}_repeats_ms"] = [round(1e3 * r["step"], 2) for r in rs]
            record[f"{side}_cpu_ms_per_rank"] = [
                statistics.median(cpu) for cpu in zip(*(r["cpu_ms"] for r in rs))
            ]
            record[f"{side}_peak_rss_mb"] = max(r["rss"] for r in rs)
            record[f"{side}_page_faults_per_step"] = round(
                statistics.median(r["faults"] for r in rs)
            )
            record[f"{side}_sharding_types"] = rs[-1]["kinds"]
        if "torchrec" in medians:
            record["ratio"] = round(medians["torchrec"] / medians["recshard"], 3)
        emit(record)


def _names(choices: Tuple[str, ...]) -> Any:
    def parse(text: str) -> List[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(choices)}")
        return names

    return parse


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--venv", type=Path, help="a venv with TorchRec (../shared/TARGETS.md)")
    side.add_argument("--no-torchrec", action="store_true", help="recshard's side alone")
    parser.add_argument("--plans", type=_names(PLANS), default=list(PLANS))
    parser.add_argument("--loops", type=_names(LOOPS), default=list(LOOPS))
    parser.add_argument(
        "--data-types",
        type=_names(DATA_TYPES),
        default=["FP32"],
        help="the tables' DataType: FP32, FP16 or both (interleaved)",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (20)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (3)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs (3)")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled")
    parser.add_argument("--profile", action="store_true", help="profile rank 0 instead of timing")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="ops listed per profile")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps (smoke test)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    defaults = (2, 1, 1) if args.quick else (20, 3, 3)
    for attr, default in zip(("steps", "warmup", "repeats"), defaults):
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    args.batch_per_rank = arch(args.quick).sizes.batch
    return args


def cli(argv: List[str] | None = None) -> None:
    compare(parse_args(argv))


if __name__ == "__main__":
    cli(sys.argv[1:])
