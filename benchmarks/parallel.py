"""Tensor-parallel dense layers: time per training step, printed as JSON lines.

    python -m benchmarks.parallel --world-sizes 1 2 4 --batch 256 --hidden 1024

Cases (forward + backward, median of `--iters` steps after `--warmup`):
  mlp            ColumnParallelLinear (no gather) -> ReLU -> RowParallelLinear
  cross_entropy  VocabParallelClassifier + ParallelCrossEntropyLoss (logits never gathered)
  gathered_ce    the same head with gathered logits + F.cross_entropy (what the above avoids)
World size 1 is the single-process baseline. Runs on gloo (CPU) or NCCL (`--device cuda`,
one GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from recshard.parallel import (
    ColumnParallelLinear,
    ParallelCrossEntropyLoss,
    RowParallelLinear,
    VocabParallelClassifier,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_steps(step: Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds per call of `step`, synchronized across ranks."""
    for _ in range(warmup):
        step()
    times: List[float] = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _cases(args: argparse.Namespace, device: torch.device) -> Dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    b, h, v = args.batch, args.hidden, args.vocab
    x = torch.randn(b, h, device=device, requires_grad=True)
    target = torch.randint(0, v, (b,), device=device)
    col = ColumnParallelLinear(h, 4 * h, gather_output=False, device=device)
    row = RowParallelLinear(4 * h, h, input_is_parallel=True, device=device)
    head = VocabParallelClassifier(h, v, device=device)
    loss_fn = ParallelCrossEntropyLoss()

    def mlp() -> None:
        row(torch.relu(col(x))).sum().backward()

    def cross_entropy() -> None:
        loss_fn(head(x), target).backward()

    gathered = ColumnParallelLinear(h, v, gather_output=True, device=device)

    def gathered_ce() -> None:
        F.cross_entropy(gathered(x), target).backward()

    return {"mlp": mlp, "cross_entropy": cross_entropy, "gathered_ce": gathered_ce}


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads))
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        for name, step in _cases(args, device).items():
            ms = _time_steps(step, args.warmup, args.iters, device)
            if rank == 0:
                record = {
                    "bench": "parallel",
                    "case": name,
                    "world_size": world_size,
                    "backend": backend,
                    "batch": args.batch,
                    "hidden": args.hidden,
                    "vocab": args.vocab,
                    "ms_per_step": round(ms, 3),
                }
                print(json.dumps(record), flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    for world_size in args.world_sizes:
        mp.spawn(_worker, args=(world_size, _free_port(), args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
