"""A table larger than memory on 2 ranks: one row-wise table of `--gib` GiB with row-wise
Adagrad trained on Zipf(1.05) ids, `key_value` (files + a `--load-factor` DRAM tier) against the
in-memory fused kernel on a table of `--fused-gib` that fits. Prints one JSON line per tier:
samples/s (median step), the DRAM tier's hit rate over the timed steps, peak RSS per rank
(VmHWM), the time to create and initialize the table and to write it out (`sync_s`, before any
step: the steps then time reads, not the init's writeback), the misses a rank reads a step,
and the machine.

The table's files go to a fresh directory under `--directory` (one per rank), removed
afterwards. Size 1.5x this machine's RAM (24 GiB) and time it once:

    flock /tmp/recshard-timing.lock python -m benchmarks.key_value_large --gib 36 --fused-gib 4

The default is small (a quarter GiB) for a smoke run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Dict

import torch
import torch.distributed as dist

from benchmarks.key_value import zipf_ids
from benchmarks.ranks import run_ranks
from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from recshard.lookup.key_value import KeyValueKernel, dram_bytes
from recshard.types import ShardingEnv


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def train(args: argparse.Namespace, kind: str, gib: float, directory: str) -> Dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = int(gib * 2**30) // (args.dim * 4)
    fused = {
        "optimizer": "exact_row_wise_adagrad",
        "learning_rate": 0.01,
        "ssd_storage_directory": os.path.join(directory, "@local_rank"),
        "cache_load_factor": args.load_factor,
    }
    config = EmbeddingBagConfig(
        num_embeddings=rows, embedding_dim=args.dim, name="big", feature_names=["f"]
    )
    module = EmbeddingBagCollection([config], device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        module, {"big": row_wise(compute_kernel=kind)}, world_size=world
    )
    rss_before = _status("VmRSS")
    start = time.perf_counter()
    sharded = EmbeddingBagCollectionSharder(fused_params=fused).shard(
        module, plan, ShardingEnv.from_process_group(dist.group.WORLD)
    )
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    os.sync()  # the init's writes out first: steps time reads, not the init's writeback
    sync_s = time.perf_counter() - start
    dist.barrier()
    kernels = [k for s in sharded.shardings.values() for k in s.lookup.kernels]
    g = torch.Generator().manual_seed(rank)
    batches = [
        KeyedJaggedTensor.from_lengths_sync(
            ["f"],
            zipf_ids(rows, args.batch * args.pooling, g),
            torch.full((args.batch,), args.pooling),
        )
        for _ in range(args.warmup + args.steps)
    ]
    times = []
    for i, features in enumerate(batches):
        if i == args.warmup:
            dist.barrier()
            for kernel in kernels:
                if isinstance(kernel, KeyValueKernel):
                    kernel.reset_hit_rate()
        begin = time.perf_counter()
        sharded(features).values().sum().backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - begin)
    times.sort()
    out = {
        "init_s": round(init_s, 1),
        "sync_s": round(sync_s, 1),
        "step_ms": round(times[len(times) // 2] * 1e3, 1),
        "step_ms_min_max": [round(times[0] * 1e3, 1), round(times[-1] * 1e3, 1)],
        "peak_rss_mb": round(_status("VmHWM") / 2**20),
        "rss_before_table_mb": round(rss_before / 2**20),
    }
    for kernel in kernels:
        if isinstance(kernel, KeyValueKernel):
            out["hit_rate"] = round(kernel.hit_rate(), 3)
            out["misses_per_step"] = round(sum(c.misses for c in kernel.caches) / args.steps)
            step_rows = args.world_size * args.batch * args.pooling  # at most, all ranks' ids
            budget = dram_bytes(kernel.tables[0], kernel.spec, step_rows)
            out["dram_budget_mb"] = round(budget / 2**20)
    return out


def run(args: argparse.Namespace, kind: str, gib: float) -> Dict:
    directory = tempfile.mkdtemp(prefix="kv-large-", dir=args.directory)
    try:
        for rank in range(args.world_size):
            os.mkdir(os.path.join(directory, str(rank)))
        per_rank = run_ranks(args.world_size, args, train, args, kind, gib, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    step_ms = max(r["step_ms"] for r in per_rank)
    return {
        "command": " ".join(["python -m benchmarks.key_value_large", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "ram_gib": round(_ram_bytes() / 2**30, 1),
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "kind": kind,
        "table_gib": gib,
        "table_over_ram": round(gib * 2**30 / _ram_bytes(), 2),
        "world_size": args.world_size,
        "samples_per_s": round(args.world_size * args.batch / (step_ms / 1e3)),
        "step_ms": step_ms,
        "per_rank": per_rank,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.25, help="the key_value table, GiB")
    parser.add_argument("--fused-gib", type=float, default=0.25, help="the in-memory table")
    parser.add_argument("--tiers", default="key_value,fused")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="per rank")
    parser.add_argument("--pooling", type=int, default=4)
    parser.add_argument("--load-factor", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--directory", default=None, help="where the table files go")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    for kind in args.tiers.split(","):
        gib = args.gib if kind == "key_value" else args.fused_gib
        print(json.dumps(run(args, kind, gib)), flush=True)


if __name__ == "__main__":
    main()
