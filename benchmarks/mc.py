"""Managed collision step cost: the sharded MC-EBC against the plain sharded EBC with the same
plan (row-wise unless `--sharding` says otherwise), on 26 one-feature tables fed raw 64-bit ids
(uniform or Zipf), their steps alternating. Prints one JSON line per distribution (rank 0):
median step ms of the plain EBC, of MC steps without an eviction and of MC steps with one, the
overhead, the same for rank 0's CPU time (`*_cpu_ms`, `cpu_overhead`), the mean step over the
whole run with its evicting steps against the plain EBC's (`run_overhead`,
`run_cpu_overhead`), the remap's share of an MC step, and the hit rate and evictions.

    python -m benchmarks.mc --world-size 2 [--rows 10000 --batch 256 --steps 20 --interval 5]
    python -m benchmarks.mc --profile mc_profile.txt   # torch.profiler table of rank 0's steps
    python -m benchmarks.mc --venv /tmp/torchrec-venv  # then TorchRec's MC-EBC, same workload
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, List, Tuple

import torch.distributed as dist

from benchmarks.launch import run_on_ranks
from benchmarks.mc_workload import DIM, LEARNING_RATE, TABLES, WARMUP, batches, step_kinds
from recshard.distributed import DistributedModelParallel
from recshard.distributed.embeddingbag import EmbeddingBagCollectionSharder
from recshard.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recshard.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from recshard.modules import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recshard.modules.mc_modules import (
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recshard.sparse import KeyedJaggedTensor
from recshard.types import ShardingPlan

FUSED = {"optimizer": "exact_sgd", "learning_rate": LEARNING_RATE}
TORCHREC_SIDE = Path(__file__).with_name("torchrec_mc.py.txt")


def _batches(args: argparse.Namespace, zipf: bool) -> List[KeyedJaggedTensor]:
    keys = [f"f{t}" for t in range(TABLES)]
    return [
        KeyedJaggedTensor.from_lengths_sync(keys, ids, lengths)
        for ids, lengths in batches(dist.get_rank(), args.batch, args.steps, zipf)
    ]


def _tables(rows: int) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(rows, DIM, name=f"t{t}", feature_names=[f"f{t}"]) for t in range(TABLES)
    ]


def _plan(module: Any, sharder: Any, sharding: str) -> ShardingPlan:
    ws = dist.get_world_size()
    per_table = {
        "row_wise": lambda t: row_wise(),
        "table_wise": lambda t: table_wise(t % ws),
        "table_row_wise": lambda t: table_row_wise(0),
        "column_wise": lambda t: column_wise(list(range(ws))),
    }[sharding]
    tables = {f"t{t}": per_table(t) for t in range(TABLES)}
    return ShardingPlan(
        {"": construct_module_sharding_plan(module, tables, sharder=sharder, world_size=ws)}
    )


def _time(
    steps: List[Tuple[Callable[[KeyedJaggedTensor], None], List[KeyedJaggedTensor]]],
) -> List[Tuple[List[float], List[float]]]:
    """Per model (a step function and its batches): wall ms and this process's CPU ms of each
    timed step (`time.process_time`: steadier than wall time on a machine shared with other
    jobs; blocking waits for the other rank are not in it). The models' steps alternate (step i
    of each, then step i + 1), so a machine whose speed drifts during the run slows them alike."""
    for step, inputs in steps:
        for kjt in inputs[:WARMUP]:
            step(kjt)
    times: List[Tuple[List[float], List[float]]] = [([], []) for _ in steps]
    for i in range(WARMUP, len(steps[0][1])):
        for (step, inputs), (wall, cpu) in zip(steps, times):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step(inputs[i])
            cpu.append((time.process_time() - start_cpu) * 1e3)
            wall.append((time.perf_counter() - start) * 1e3)
    return times


def _mc_model(args: argparse.Namespace) -> DistributedModelParallel:
    tables = _tables(args.rows)
    ws = dist.get_world_size()
    mcc = ManagedCollisionCollection(
        {
            t.name: MCHManagedCollisionModule(
                args.rows, "cpu", LFU_EvictionPolicy(), args.interval, buckets=ws
            )
            for t in tables
        },
        tables,
    )
    module = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), mcc)
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(fused_params=FUSED)
    return DistributedModelParallel(
        module, plan=_plan(module, sharder, args.sharding), sharders=[sharder]
    )


def _timed_remap(model: DistributedModelParallel) -> Tuple[Any, List[float]]:
    sharded = next(
        m for m in model.modules() if isinstance(m, BaseShardedManagedCollisionEmbeddingCollection)
    )
    mcc = sharded._managed_collision_collection
    remap, remap_ms = mcc.remap, []

    def timed_remap(*a, **k):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        out = remap(*a, **k)
        remap_ms.append((time.perf_counter() - start) * 1e3)
        return out

    mcc.remap = timed_remap
    return mcc, remap_ms


def _measure(args: argparse.Namespace, zipf: bool) -> None:
    """One JSON line (rank 0) for one id distribution."""
    batches = _batches(args, zipf)
    ebc = EmbeddingBagCollection(_tables(args.rows))
    ebc_sharder = EmbeddingBagCollectionSharder(FUSED)
    plain = DistributedModelParallel(
        ebc, plan=_plan(ebc, ebc_sharder, args.sharding), sharders=[ebc_sharder]
    )
    folded = [
        KeyedJaggedTensor.from_lengths_sync(b.keys(), b.values() % args.rows, b.lengths())
        for b in batches
    ]
    model = _mc_model(args)
    mcc, remap_ms = _timed_remap(model)
    (plain_wall, plain_cpu), (mc_ms, mc_cpu) = _time(
        [
            (lambda kjt: plain(kjt).values().sum().backward(), folded),
            (lambda kjt: model(kjt)[0].values().sum().backward(), batches),
        ]
    )
    plain_ms, plain_cpu_ms = statistics.median(plain_wall), statistics.median(plain_cpu)
    remap_ms = remap_ms[WARMUP:]
    evicts = step_kinds(len(mc_ms), args.interval)
    quiet = [t for t, e in zip(mc_ms, evicts) if not e]
    busy = [t for t, e in zip(mc_ms, evicts) if e]
    quiet_cpu = [t for t, e in zip(mc_cpu, evicts) if not e]
    busy_cpu = [t for t, e in zip(mc_cpu, evicts) if e]
    quiet_remap = [t for t, e in zip(remap_ms, evicts) if not e]
    metrics = [m.metrics() for m in mcc.local_modules().values()]
    if args.profile and dist.get_rank() == 0:
        _profile(model, batches, args.profile)
    if dist.get_rank() == 0:
        lookups = sum(m["lookups"] for m in metrics)
        median = statistics.median
        line = {
            "bench": "mc_step",
            "ids": "zipf" if zipf else "uniform",
            "sharding": args.sharding,
            "world_size": dist.get_world_size(),
            "tables": TABLES,
            "rows": args.rows,
            "batch_per_rank": args.batch,
            "eviction_interval": args.interval,
            "plain_ebc_step_ms": round(plain_ms, 3),
            "mc_step_ms": round(median(quiet), 3) if quiet else None,
            "mc_evicting_step_ms": round(median(busy), 3) if busy else None,
            "overhead": round(median(quiet) / plain_ms - 1, 3) if quiet else None,
            "plain_ebc_step_cpu_ms": round(plain_cpu_ms, 3),
            "mc_step_cpu_ms": round(median(quiet_cpu), 3) if quiet_cpu else None,
            "cpu_overhead": round(median(quiet_cpu) / plain_cpu_ms - 1, 3) if quiet_cpu else None,
            "mc_evicting_step_cpu_ms": round(median(busy_cpu), 3) if busy_cpu else None,
            # over the whole run (one step in `interval` evicts): mean MC step against the
            # mean plain step, wall and CPU
            "mc_mean_step_ms": round(statistics.mean(mc_ms), 3),
            "run_overhead": round(statistics.mean(mc_ms) / statistics.mean(plain_wall) - 1, 3),
            "mc_mean_step_cpu_ms": round(statistics.mean(mc_cpu), 3),
            "run_cpu_overhead": round(statistics.mean(mc_cpu) / statistics.mean(plain_cpu) - 1, 3),
            "remap_share_of_mc_step": round(median(quiet_remap) / median(quiet), 3)
            if quiet
            else None,
            "hit_rate_rank0": round(sum(m["hits"] for m in metrics) / lookups, 3),
            "rows_in_use_rank0": sum(int(m["rows_in_use"]) for m in metrics),
            "evicted_rank0": sum(int(m["evicted"]) for m in metrics),
        }
        print(json.dumps(line), flush=True)


def _profile(model: DistributedModelParallel, batches: List[KeyedJaggedTensor], path: str) -> None:
    """The batches again, forward and backward under torch.profiler, on rank 0 alone: use it
    with `--world-size 1` (other ranks would wait for rank 0's collectives)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
        for kjt in batches[WARMUP:]:
            model(kjt)[0].values().sum().backward()
    with open(path, "w") as out:
        out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


def main(args: argparse.Namespace) -> None:
    for zipf in (False, True):
        _measure(args, zipf)


def torchrec_side(args: argparse.Namespace) -> None:
    """TorchRec's MC-EBC on the same workload (`torchrec_mc.py.txt` with the venv's python,
    after recshard's ranks have exited): its JSON lines, as printed."""
    command = [f"{args.venv}/bin/python", str(TORCHREC_SIDE), "--world-size"]
    command += [str(args.world_size), "--rows", str(args.rows), "--batch", str(args.batch)]
    command += ["--steps", str(args.steps), "--interval", str(args.interval)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    lines = [ln[len("RESULT ") :] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"TorchRec's side failed ({done.returncode}): {done.stderr[-2000:]}")
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument(
        "--sharding",
        default="row_wise",
        choices=["row_wise", "table_wise", "table_row_wise", "column_wise"],
    )
    parser.add_argument("--profile", default="", help="(with --world-size 1) profiler table file")
    parser.add_argument(
        "--venv", default="", help="a TorchRec venv: also time TorchRec's MC-EBC (row-wise)"
    )
    parsed = parser.parse_args()
    if parsed.profile and parsed.world_size != 1:
        parser.error("--profile runs on rank 0 alone: use it with --world-size 1")
    if parsed.venv and parsed.sharding != "row_wise":
        parser.error("--venv compares row-wise plans only (TorchRec shards MC row-wise)")
    run_on_ranks(main, parsed, parsed.world_size)
    if parsed.venv:
        torchrec_side(parsed)
