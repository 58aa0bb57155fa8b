"""Communication benchmarks: payload bytes/s of KJT and pooled all-to-all, fp32 vs fp16, and
how much compute overlaps an in-flight all-to-all. Prints one JSON line per measurement.

    python -m benchmarks.comm                 # spawns 2 gloo ranks on this machine
    python -m benchmarks.comm --quick         # smaller sizes, fewer repeats
    torchrun --nproc-per-node 2 -m benchmarks.comm   # under torchrun (any backend env)

Times are medians over `--repeats` runs (each the slowest rank's time), seeds fixed.
`payload_bytes` is what this rank hands to the collectives per run (forward only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from benchmarks.launch import run_on_ranks
from recshard.comm import (
    FP16CommCodec,
    KJTAllToAll,
    PooledEmbeddingsAllToAll,
    QuantizedCommCodecs,
    comm_payload_bytes,
    reset_comm_payload_bytes,
)
from recshard.sparse import KeyedJaggedTensor


def _timed(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `repeats` runs, each the slowest rank's time."""
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed))
    return statistics.median(times)


def _payload(fn: Callable[[], object]) -> int:
    reset_comm_payload_bytes()
    fn()
    return sum(comm_payload_bytes().values())


def _emit(record: Dict[str, object]) -> None:
    if dist.get_rank() == 0:
        print(json.dumps(record), flush=True)


def bench_pooled(sizes: List[tuple], repeats: int) -> None:
    """Table-wise pooled all-to-all: `[W * B, D]` per rank -> `[B, W * D]`."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    for batch, dim in sizes:
        g = torch.Generator().manual_seed(rank)
        embs = torch.randn(ws * batch, dim, generator=g)
        for precision in ("fp32", "fp16"):
            codec = FP16CommCodec() if precision == "fp16" else None
            codecs = QuantizedCommCodecs(codec, codec) if codec else None
            a2a = PooledEmbeddingsAllToAll(dist.group.WORLD, [dim] * ws, codecs=codecs)

            def run(a2a: PooledEmbeddingsAllToAll = a2a, embs: torch.Tensor = embs) -> torch.Tensor:
                return a2a(embs).wait()

            seconds, payload = _timed(run, repeats), _payload(run)
            _emit(
                dict(
                    bench="pooled_all_to_all",
                    world_size=ws,
                    precision=precision,
                    batch_per_rank=batch,
                    dim_per_rank=dim,
                    payload_bytes=payload,
                    median_s=round(seconds, 6),
                    payload_bytes_per_s=round(payload / seconds),
                )
            )


def _kjt(num_keys: int, batch: int, mean_len: int, seed: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(
        0, 2 * mean_len + 1, (num_keys * batch,), generator=g, dtype=torch.int32
    )
    values = torch.randint(0, 1 << 30, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        [f"f{k}" for k in range(num_keys)], values, lengths, weights, stride=batch
    )


def bench_kjt(sizes: List[tuple], repeats: int) -> None:
    """Two-stage KJT all-to-all (splits, then lengths / values / weights), keys spread evenly."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    for num_keys, batch, mean_len in sizes:
        for weighted in (False, True):
            kjt = _kjt(num_keys, batch, mean_len, seed=rank, weighted=weighted)
            splits = [num_keys // ws + (1 if r < num_keys % ws else 0) for r in range(ws)]
            a2a = KJTAllToAll(dist.group.WORLD, splits)

            def run(a2a: KJTAllToAll = a2a, kjt: KeyedJaggedTensor = kjt) -> KeyedJaggedTensor:
                return a2a(kjt).wait().wait()

            seconds, payload = _timed(run, repeats), _payload(run)
            _emit(
                dict(
                    bench="kjt_all_to_all",
                    world_size=ws,
                    weighted=weighted,
                    keys=num_keys,
                    batch_per_rank=batch,
                    ids_per_rank=kjt.values().numel(),
                    payload_bytes=payload,
                    median_s=round(seconds, 6),
                    payload_bytes_per_s=round(payload / seconds),
                )
            )


def bench_overlap(batch: int, dim: int, repeats: int) -> None:
    """Compute alone, a large pooled all-to-all alone, and compute while it is in flight.

    The compute (chained 384x384 matmuls) is sized to take about as long as the all-to-all,
    so `hidden_fraction` (how much of the shorter one disappears when overlapped: 1 = all,
    0 = none) is not flattered by one side dwarfing the other.
    """
    ws, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    embs = torch.randn(ws * batch, dim, generator=g)
    a = torch.randn(384, 384, generator=g) / 384**0.5
    a2a = PooledEmbeddingsAllToAll(dist.group.WORLD, [dim] * ws)

    def compute(matmuls: int) -> torch.Tensor:
        x = a
        for _ in range(matmuls):
            x = torch.tanh(x @ a)
        return x

    comm_s = _timed(lambda: a2a(embs).wait(), repeats)
    per_matmul = _timed(lambda: compute(20), repeats) / 20
    matmuls = torch.tensor([max(1, round(comm_s / per_matmul))])
    dist.broadcast(matmuls, 0)  # the same work on every rank
    matmuls = int(matmuls)

    def both() -> None:
        pending = a2a(embs)  # issued: gloo moves the bytes on its own threads
        compute(matmuls)
        pending.wait()

    compute_s = _timed(lambda: compute(matmuls), repeats)
    comm_s = _timed(lambda: a2a(embs).wait(), repeats)
    both_s = _timed(both, repeats)
    hidden = (compute_s + comm_s - both_s) / min(compute_s, comm_s)
    _emit(
        dict(
            bench="overlap",
            world_size=ws,
            payload_bytes=embs.numel() * embs.element_size(),
            matmuls=matmuls,
            compute_s=round(compute_s, 6),
            all_to_all_s=round(comm_s, 6),
            overlapped_s=round(both_s, 6),
            serial_s=round(compute_s + comm_s, 6),
            hidden_fraction=round(hidden, 3),
            torch_threads=torch.get_num_threads(),
        )
    )


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    if args.quick:
        pooled = [(256, 32), (1024, 64), (4096, 128)]
        kjt = [(8, 256, 4), (16, 1024, 8), (32, 2048, 16)]
        overlap = (4096, 256)
    else:
        pooled = [(512, 64), (2048, 128), (8192, 256), (16384, 512)]
        kjt = [(8, 512, 4), (26, 2048, 10), (64, 4096, 20)]
        overlap = (16384, 256)
    bench_pooled(pooled, args.repeats)
    bench_kjt(kjt, args.repeats)
    bench_overlap(*overlap, repeats=args.repeats)


def cli(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    run_on_ranks(main, args, args.world_size, args.threads)


if __name__ == "__main__":
    cli()
