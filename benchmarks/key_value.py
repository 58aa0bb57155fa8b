"""Key-value tables on one process: step time, DRAM-tier hit rate and resident memory growth of
three ways to hold one table, on Zipf(1.05) ids. Prints one JSON line per tier.

- `row_cache`: `compute_kernel="key_value"` (files + an LRU row cache of `--load-factor`).
- `row_cache_prefetch`: the same, batch i+1's rows read on a side thread while batch i runs
  backward (what `PrefetchTrainPipelineSparseDist` does).
- `page_cache`: the pure-torch fused kernel with its weight and state buffers replaced by
  mappings of files (the OS page cache is the DRAM tier; no bound of its own).
- `in_memory`: the pure-torch fused kernel (the table in DRAM).
- `in_memory_native`: recshard's C++ fused kernel (`NativeFusedKernel`), the in-memory kernel
  the library builds for this table (fp32, pooled, row-wise Adagrad), whose math the key-value
  kernel runs on its cache where it covers the table.

    flock /tmp/recshard-timing.lock python -m benchmarks.key_value --rows 1000000 --dim 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List

import torch

from recshard import EmbeddingBagConfig, KeyedJaggedTensor
from recshard.lookup.fused_params import FusedParams
from recshard.lookup.kernels import LookupKernel, TorchFusedKernel
from recshard.lookup.key_value import KeyValueKernel, dram_bytes
from recshard.lookup.native_kernel import NativeFusedKernel
from recshard.lookup.tables import LocalTable
from recshard.types import EmbeddingComputeKernel


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def zipf_ids(rows: int, count: int, generator: torch.Generator, a: float = 1.05) -> torch.Tensor:
    """Zipf(a) ranks by inverse CDF on a continuous approximation, scattered over the rows by
    a fixed permutation-free hash (hot rows are not neighbours on storage)."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    ranks = ((1 - u) * (rows ** (1 - a) - 1) + 1) ** (1 / (1 - a))
    ranks = ranks.long().clamp(1, rows) - 1
    return (ranks * 2654435761) % rows


def _table(args: argparse.Namespace, kernel: EmbeddingComputeKernel, fused: Dict) -> LocalTable:
    config = EmbeddingBagConfig(
        num_embeddings=args.rows, embedding_dim=args.dim, name="t", feature_names=["f"]
    )
    return LocalTable(
        config, args.rows, args.dim, 0, 0, kernel, config.pooling, FusedParams.parse(fused, "t")
    )


def _map_buffers(kernel: TorchFusedKernel, directory: str) -> None:
    """Replace the kernel's buffers with file mappings holding the same values."""
    for name, buffer in list(kernel.named_buffers()):
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(buffer.numpy().tobytes())
        mapped = torch.from_file(path, shared=True, size=buffer.numel()).view(buffer.shape)
        setattr(kernel, name, mapped)


def run(args: argparse.Namespace, tier: str) -> Dict:
    """One tier's result; its table's files are deleted afterwards, whatever happens."""
    directory = tempfile.mkdtemp(prefix="kv-bench-", dir=args.directory)
    try:
        return _run(args, tier, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run(args: argparse.Namespace, tier: str, directory: str) -> Dict:
    fused = {
        "optimizer": "exact_row_wise_adagrad",
        "learning_rate": 0.01,
        "ssd_storage_directory": directory,
        "cache_load_factor": args.load_factor,
    }
    spec = FusedParams.parse(fused, "t").optim
    key_value = tier.startswith("row_cache")
    kind = EmbeddingComputeKernel.KEY_VALUE if key_value else EmbeddingComputeKernel.FUSED
    table = _table(args, kind, fused)
    g = torch.Generator().manual_seed(0)
    batches: List[KeyedJaggedTensor] = [
        KeyedJaggedTensor.from_lengths_sync(
            ["f"],
            zipf_ids(args.rows, args.batch * args.pooling, g),
            torch.full((args.batch,), args.pooling),
        )
        for _ in range(args.steps + args.warmup)
    ]
    before = rss()
    kernel: LookupKernel
    if key_value:
        kernel = KeyValueKernel([table], True, spec, torch.device("cpu"))
    elif tier == "in_memory_native":
        kernel = NativeFusedKernel([table], True, spec, torch.device("cpu"))
    else:
        kernel = TorchFusedKernel([table], True, spec, torch.device("cpu"))
        if tier == "page_cache":
            _map_buffers(kernel, directory)
    os.sync()  # the table's init written out: time steady-state steps, not its writeback
    times, cpu_times = [], []
    for i, features in enumerate(batches):
        if i == args.warmup and isinstance(kernel, KeyValueKernel):
            kernel.reset_hit_rate()  # the timed steps' hit rate, the cache warm
        start, cpu_start = time.perf_counter(), time.process_time()
        out = kernel(features)
        side = None
        if tier == "row_cache_prefetch" and i + 1 < len(batches):
            side = threading.Thread(target=kernel.prefetch, args=(batches[i + 1],))
            side.start()
        out.sum().backward()
        if side is not None:
            side.join()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    times.sort()
    cpu_times.sort()
    step = times[len(times) // 2]
    result = {
        "command": shlex.join(
            [sys.executable.rsplit("/", 1)[-1], "-m", __spec__.name, *sys.argv[1:]]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tier": tier,
        "rows": args.rows,
        "dim": args.dim,
        "table_mb": round(args.rows * args.dim * 4 / 2**20, 1),
        "step_ms": round(step * 1e3, 2),  # median of --steps
        "cpu_ms": round(cpu_times[len(cpu_times) // 2] * 1e3, 2),  # all threads, median
        "samples_per_s": round(args.batch / step),
        "rss_growth_mb": round((rss() - before) / 2**20, 1),
    }
    if key_value:
        result["hit_rate"] = round(kernel.hit_rate(), 3)
        step_rows = args.batch * args.pooling  # at most
        result["dram_budget_mb"] = round(dram_bytes(table, spec, step_rows) / 2**20, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--pooling", type=int, default=4)
    parser.add_argument("--load-factor", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--warmup", type=int, default=50, help="untimed steps first (the cache fills up)"
    )
    parser.add_argument("--directory", default=None, help="where the table files go")
    parser.add_argument(
        "--tiers", default="in_memory,in_memory_native,row_cache,row_cache_prefetch,page_cache"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    for tier in args.tiers.split(","):
        print(json.dumps(run(args, tier)), flush=True)


if __name__ == "__main__":
    main()
