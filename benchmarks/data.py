"""Criteo input throughput next to the training step's, as JSON lines.

    python -m benchmarks.data --rows 200000 --repeats 3

Builds a TSV file of `--rows` rows (the shared samples repeated), preprocesses it once, and
then, `--repeats` times and interleaved (a busy machine slows every stage alike), times on
rank 0, one core each:
  - stage "tsv": the TSV reader (`criteo_loader`, no workers), up to `--tsv-rows` rows;
  - stage "preprocess": `preprocess` of the whole file, one worker, into a fresh directory;
  - stage "binary": epochs of `BinaryCriteo` (batch 512, shuffle buffer 64 batches), >= 0.5 s;
and "train": `--train-steps` steps of the `--demo` DLRM on every rank (pipelined, fused,
one torch thread per rank) fed from batches already in memory, so only the step is timed.
Each line reports the median over rounds; the last line is the binary loader's rows/s over
the training step's global samples/s (the loader must keep up with all ranks on one core).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from examples.dlrm.args import parse_args
from examples.dlrm.data.binary import BinaryCriteo
from examples.dlrm.data.criteo import criteo_loader
from examples.dlrm.data.preprocess import VocabSettings, preprocess
from examples.dlrm.train import Runner, build_training

SAMPLES = Path(__file__).resolve().parents[1] / "../shared/data/criteo"
TSV_SAMPLES = ("paddlerec_part-0_100.txt", "pytorch-fm_fork_criteo_train_1000.txt")
BATCH = 512


def write_rows(path: Path, rows: int) -> None:
    """`rows` lines of the shared TSV samples, repeated."""
    lines = []
    for name in TSV_SAMPLES:
        lines += (SAMPLES / name).read_text().splitlines()
    with open(path, "w") as f:
        for start in range(0, rows, len(lines)):
            f.write("\n".join(lines[: min(len(lines), rows - start)]) + "\n")


def _timed(fn: Callable[[], int]) -> float:
    """Rows per second of one call of `fn` (which returns the rows it handled)."""
    start = time.perf_counter()
    rows = fn()
    return rows / (time.perf_counter() - start)


def _data_stages(
    bench: argparse.Namespace, work: Path, settings: VocabSettings, sizes: List[int]
) -> Dict[str, Callable[[], int]]:
    tsv = str(work / "input" / "criteo.txt")
    binary = str(work / "bin")
    rounds = itertools.count()

    def read_tsv() -> int:
        loader = criteo_loader(tsv, sizes, BATCH, split="all", num_workers=0)
        return sum(b.batch_size for b in itertools.islice(loader, bench.tsv_rows // BATCH))

    def convert() -> int:
        out = work / f"pre{next(rounds)}"
        preprocess([tsv], str(out), settings, workers=1)
        shutil.rmtree(out)
        return bench.rows

    def load() -> int:  # epochs for at least half a second
        rows, start = 0, time.perf_counter()
        for epoch in itertools.count():
            loader = BinaryCriteo(binary, BATCH, "all", shuffle_buffer=64 * BATCH, epoch=epoch)
            rows += sum(b.batch_size for b in loader)
            if time.perf_counter() - start > 0.5:
                return rows
        raise AssertionError("unreachable")

    return {"tsv": read_tsv, "preprocess": convert, "binary": load}


def _worker(rank: int, world_size: int, port: int, bench: argparse.Namespace, work: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=600)
    )
    try:
        args = parse_args(
            [
                "--demo",
                "--data",
                "criteo",
                "--data-path",
                str(work / "bin"),
                "--seed",
                str(bench.seed),
            ]
        )
        dmp, optimizer, _, _ = build_training(args, torch.device("cpu"), world_size, world_size)
        step = Runner(dmp, optimizer, torch.device("cpu"), True, lambda _: None).step
        batches = itertools.cycle(
            list(
                itertools.islice(
                    BinaryCriteo(str(work / "bin"), args.batch_size, "all", rank, world_size), 32
                )
            )
        )
        for _ in range(bench.warmup):
            step(batches)
        settings = VocabSettings("hash", args.num_embeddings_per_feature, 0, 10)
        stages = _data_stages(bench, work, settings, args.num_embeddings_per_feature)
        rates: Dict[str, List[float]] = {name: [] for name in [*stages, "train"]}
        for _ in range(bench.repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(bench.train_steps):
                step(batches)
            dist.barrier()
            seconds = time.perf_counter() - start
            rates["train"].append(bench.train_steps * args.batch_size * world_size / seconds)
            if rank == 0:
                for name, fn in stages.items():
                    rates[name].append(_timed(fn))
            dist.barrier()
        if rank == 0:
            _report(bench, rates, world_size, args.batch_size)
    finally:
        dist.destroy_process_group()


def _report(
    bench: argparse.Namespace, rates: Dict[str, List[float]], world_size: int, batch_size: int
) -> None:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    common = {
        "bench": "data",
        "rows": bench.rows,
        "repeats": bench.repeats,
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }
    for name in ("tsv", "preprocess", "binary"):
        print(
            json.dumps(
                {
                    **common,
                    "stage": name,
                    "rows_per_s": round(medians[name]),
                    "rows_per_s_all": [round(v) for v in rates[name]],
                }
            ),
            flush=True,
        )
    print(
        json.dumps(
            {
                **common,
                "stage": "train",
                "samples_per_s": round(medians["train"]),
                "samples_per_s_all": [round(v) for v in rates["train"]],
                "world_size": world_size,
                "batch_size_per_rank": batch_size,
                "config": "--demo, pipelined, fused, 1 thread per rank",
            }
        ),
        flush=True,
    )
    ratios = [b / t for b, t in zip(rates["binary"], rates["train"])]
    print(
        json.dumps(
            {
                **common,
                "stage": "summary",
                "binary_over_train": round(statistics.median(ratios), 2),
                "binary_over_train_all": [round(r, 2) for r in ratios],
                "binary_over_tsv": round(medians["binary"] / medians["tsv"], 1),
                "preprocess_over_tsv": round(medians["preprocess"] / medians["tsv"], 1),
            }
        ),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000, help="rows of the generated TSV file")
    p.add_argument("--tsv-rows", type=int, default=50_000, help="rows read by the TSV stage")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--train-steps", type=int, default=30, help="training steps per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    bench = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="recshard_data_bench_") as tmp:
        work = Path(tmp)
        (work / "input").mkdir()
        write_rows(work / "input" / "criteo.txt", bench.rows)
        demo = parse_args(["--demo"])
        preprocess(
            [str(work / "input")],
            str(work / "bin"),
            VocabSettings("hash", demo.num_embeddings_per_feature, 0, 10),
            workers=1,
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(
            _worker, args=(bench.world_size, port, bench, work), nprocs=bench.world_size, join=True
        )


if __name__ == "__main__":
    main()
