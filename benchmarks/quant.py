"""Quantization benchmarks: quantized lookup throughput and bytes per table (fp32/fp16/int8/
int4/int2 rows in fbgemm's inference kernel, and the float EBC), and the pooled all-to-all /
reduce-scatter with fp32, fp16 and bf16 comm codecs. Prints one JSON line per measurement.

    python -m benchmarks.quant                # lookups in this process, then 2 gloo ranks
    python -m benchmarks.quant --quick        # smaller sizes, fewer repeats

Seeds are fixed; times are medians over `--repeats` runs. Lookup runs interleave the dtypes
(one forward of each per round) so machine noise hits all of them alike. Collective times
are the slowest rank's; `payload_bytes` is what one rank hands to the collective per call.
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
from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.comm import (
    CommOp,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    codecs_from_registry,
    comm_payload_bytes,
    get_qcomm_codecs_registry,
    reset_comm_payload_bytes,
)
from recshard.quant import QuantEmbeddingBagCollection

LOOKUP_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "int8": torch.qint8,
    "int4": torch.quint4x2,
    "int2": torch.quint2x4,
}


def _emit(record: Dict[str, object]) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(record), flush=True)


# ------------------------------------------------------------------------------ lookups


def _batch(num_tables: int, rows: int, batch: int, pooling: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * pooling + 1, (num_tables * batch,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(
        [f"f{t}" for t in range(num_tables)], values, lengths
    )


def bench_lookups(
    num_tables: int, rows: int, dim: int, batch: int, pooling: int, repeats: int
) -> None:
    """Forward of the float EBC and of its quantized twins on the same batches."""
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(
            num_embeddings=rows, embedding_dim=dim, name=f"t{t}", feature_names=[f"f{t}"]
        )
        for t in range(num_tables)
    ]
    float_ebc = EmbeddingBagCollection(configs)
    modules: Dict[str, torch.nn.Module] = {"float_ebc": float_ebc}
    for name, dtype in LOOKUP_DTYPES.items():
        modules[f"quant_{name}"] = QuantEmbeddingBagCollection.from_float(float_ebc, dtype)
    batches = [_batch(num_tables, rows, batch, pooling, seed) for seed in range(4)]
    ids = statistics.mean(b.values().numel() for b in batches)
    times: Dict[str, List[float]] = {name: [] for name in modules}
    with torch.inference_mode():
        reference = float_ebc(batches[0]).values()
        for round_ in range(repeats + 2):  # two warm-up rounds
            kjt = batches[round_ % len(batches)]
            for name, module in modules.items():
                start = time.perf_counter()
                module(kjt)
                if round_ >= 2:
                    times[name].append(time.perf_counter() - start)
        for name, module in modules.items():
            seconds = statistics.median(times[name])
            if name == "float_ebc":
                table_bytes = rows * dim * 4
                max_error = 0.0
            else:
                table_bytes = module.storage_bytes() / num_tables
                max_error = (module(batches[0]).values() - reference).abs().max().item()
            _emit(
                dict(
                    bench="lookup",
                    name=name,
                    tables=num_tables,
                    rows=rows,
                    dim=dim,
                    batch=batch,
                    ids_per_batch=round(ids),
                    median_ms=round(seconds * 1e3, 3),
                    ids_per_s=round(ids / seconds),
                    samples_per_s=round(batch / seconds),
                    bytes_per_table=round(table_bytes),
                    bytes_per_row=round(table_bytes / rows, 2),
                    size_vs_fp32=round(rows * dim * 4 / table_bytes, 3),
                    max_abs_error_vs_fp32=round(max_error, 6),
                    threads=torch.get_num_threads(),
                )
            )


# ------------------------------------------------------------------------------ collectives


def _slowest_rank_seconds(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _payload(fn: Callable[[], object]) -> int:
    reset_comm_payload_bytes()
    fn()
    return sum(comm_payload_bytes().values())


def bench_collectives(sizes: List[tuple], repeats: int) -> None:
    """Pooled all-to-all (table-wise) and reduce-scatter (row-wise) per codec, forward alone and
    forward + backward (the gradients go back through the backward codec). The codecs are
    interleaved: each round times every case once."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    for batch, dim in sizes:
        g = torch.Generator().manual_seed(rank)
        embs = torch.randn(ws * batch, dim, generator=g)
        grads = {
            "pooled_all_to_all": torch.randn(batch, ws * dim, generator=g),
            "pooled_reduce_scatter": torch.randn(batch, dim, generator=g),
        }
        cases: Dict[tuple, Callable[[], object]] = {}
        for precision in ("fp32", "fp16", "bf16"):
            registry = get_qcomm_codecs_registry(precision)
            modules = {
                "pooled_all_to_all": PooledEmbeddingsAllToAll(
                    dist.group.WORLD,
                    [dim] * ws,
                    codecs=codecs_from_registry(registry, CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL),
                ),
                "pooled_reduce_scatter": PooledEmbeddingsReduceScatter(
                    dist.group.WORLD,
                    codecs=codecs_from_registry(registry, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER),
                ),
            }
            for bench, module in modules.items():
                cases[(bench, precision, "forward")] = lambda m=module, x=embs: m(x).wait()
                cases[(bench, precision, "forward_backward")] = (
                    lambda m=module, x=embs, grad=grads[bench]: _backward(m, x, grad)
                )
        times: Dict[tuple, List[float]] = {key: [] for key in cases}
        for round_ in range(repeats + 2):  # two warm-up rounds
            for key, fn in cases.items():
                seconds = _slowest_rank_seconds(fn)
                if round_ >= 2:
                    times[key].append(seconds)
        for (bench, precision, direction), fn in cases.items():
            seconds = statistics.median(times[(bench, precision, direction)])
            payload = _payload(fn)
            _emit(
                dict(
                    bench=bench,
                    world_size=ws,
                    precision=precision,
                    direction=direction,
                    batch_per_rank=batch,
                    dim=dim,
                    payload_bytes=payload,
                    median_ms=round(seconds * 1e3, 3),
                    payload_bytes_per_s=round(payload / seconds),
                )
            )


def _backward(module: torch.nn.Module, embs: torch.Tensor, grad: torch.Tensor) -> None:
    leaf = embs.detach().requires_grad_()
    module(leaf).wait().backward(grad)


# ------------------------------------------------------------------------------ entry


def _collectives(args: argparse.Namespace) -> None:
    sizes = [(256, 64), (2048, 128)] if args.quick else [(512, 64), (4096, 128), (8192, 256)]
    bench_collectives(sizes, args.repeats)


def cli(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="default 20 (5 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["lookups", "collectives"], default=None)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.quick else 20
    torch.set_num_threads(args.threads)
    if args.only != "collectives":
        if args.quick:
            bench_lookups(
                num_tables=4, rows=20_000, dim=64, batch=256, pooling=8, repeats=args.repeats
            )
        else:
            bench_lookups(
                num_tables=8, rows=100_000, dim=128, batch=2048, pooling=20, repeats=args.repeats
            )
    if args.only != "lookups":
        run_on_ranks(_collectives, args, args.world_size, args.threads)


if __name__ == "__main__":
    cli()
