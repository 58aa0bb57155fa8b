"""End-to-end DLRM training throughput (the `--demo` configuration), as JSON lines.

    python -m benchmarks.dlrm --world-size 2 --steps 50 --repeats 3
    python -m benchmarks.dlrm --link 1gbit            # on a loopback shaped to 1 Gbit/s

For each case (pipeline on/off x fused/dense kernel) every rank builds the demo model
(same seed) and trains `--warmup` steps; then `--repeats` rounds time one block of `--steps`
steps of every case in turn (interleaved, so a busy machine slows all cases alike), each on
its own synthetic stream (batch generation included, as in the demo). A block's global
samples/s is `steps * batch * world_size / seconds` between barriers; each line reports
the median over blocks. `wait_share` is rank 0's time blocked in collective waits over its
block time, by kind (`benchmarks/link.py`); `--link RATE` re-runs on a shaped loopback and every
line carries `link`. Runs on gloo (CPU) or NCCL (one GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.link import CollectiveWaitClock, add_link_argument, link_label, relaunch_under_link

CASES = [("pipeline", "fused"), ("plain", "fused"), ("pipeline", "dense"), ("plain", "dense")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pipeline_available() -> bool:
    from examples.dlrm.train import _pipeline_classes

    return _pipeline_classes() is not None


def _build_case(
    bench: argparse.Namespace,
    loop: str,
    kernel: str,
    rank: int,
    world_size: int,
    device: torch.device,
) -> Dict[str, Any]:
    """One case's model, optimizer, step function and batch stream, warmed up."""
    from examples.dlrm.args import parse_args
    from examples.dlrm.data.loaders import train_batches
    from examples.dlrm.train import Runner, build_training

    argv = [
        "--demo",
        "--kernel",
        kernel,
        "--seed",
        str(bench.seed),
        "--pipeline" if loop == "pipeline" else "--no-pipeline",
    ]
    if bench.batch_size:
        argv += ["--batch-size", str(bench.batch_size)]
    args = parse_args(argv)
    args.steps = bench.warmup + bench.steps * bench.repeats
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    dmp, optimizer, _, _ = build_training(args, device, world_size, local_size)
    step = Runner(dmp, optimizer, device, loop == "pipeline", lambda _: None).step
    batches = train_batches(args, rank, world_size, 0, None)
    for _ in range(bench.warmup):
        step(batches)
    return {
        "loop": loop,
        "kernel": kernel,
        "args": args,
        "step": step,
        "batches": batches,
        "rates": [],
        "wait_shares": [],
    }


def _time_block(
    bench: argparse.Namespace,
    case: Dict[str, Any],
    world_size: int,
    device: torch.device,
    waits: CollectiveWaitClock,
) -> None:
    """Run `bench.steps` steps of one case between barriers; record global samples/s."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    waits.take()
    start = time.perf_counter()
    for _ in range(bench.steps):
        case["step"](case["batches"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = time.perf_counter() - start
    case["wait_shares"].append(waits.take().shares(1e3 * seconds))
    case["rates"].append(bench.steps * case["args"].batch_size * world_size / seconds)


def _report(
    bench: argparse.Namespace, case: Dict[str, Any], world_size: int, device: torch.device
) -> Dict[str, Any]:
    args, rates = case["args"], case["rates"]
    median = statistics.median(rates)
    return {
        "bench": "dlrm_e2e",
        "link": link_label(),
        "loop": case["loop"],
        "kernel": case["kernel"],
        "world_size": world_size,
        "device": device.type,
        "batch_size_per_rank": args.batch_size,
        "embedding_dim": args.embedding_dim,
        "tables": len(args.num_embeddings_per_feature),
        "steps_per_block": bench.steps,
        "blocks": bench.repeats,
        "seed": bench.seed,
        "samples_per_s_median": round(median, 1),
        "ms_per_step_median": round(1e3 * args.batch_size * world_size / median, 3),
        "samples_per_s": [round(r, 1) for r in rates],
        "wait_share": {
            k: statistics.median(s[k] for s in case["wait_shares"]) for k in case["wait_shares"][0]
        },
    }


def _worker(rank: int, world_size: int, port: int, bench: argparse.Namespace) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(bench.threads)
    use_cuda = bench.device == "cuda"
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    try:
        cases = []
        for loop, kernel in CASES:
            if kernel not in bench.kernels or loop not in bench.loops:
                continue
            if loop == "pipeline" and not _pipeline_available():
                if rank == 0:
                    print(
                        json.dumps(
                            {
                                "bench": "dlrm_e2e",
                                "link": link_label(),
                                "loop": loop,
                                "kernel": kernel,
                                "skipped": "recshard has no TrainPipelineSparseDist",
                            }
                        ),
                        flush=True,
                    )
                continue
            cases.append(_build_case(bench, loop, kernel, rank, world_size, device))
        waits = CollectiveWaitClock()
        for _ in range(bench.repeats):  # interleaved, so load drift hits every case alike
            for case in cases:
                _time_block(bench, case, world_size, device, waits)
        waits.close()
        for case in cases:
            if rank == 0:
                print(json.dumps(_report(bench, case, world_size, device)), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=50, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks (median reported)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=0, help="per rank (0: the demo's)")
    p.add_argument("--kernels", nargs="+", default=["fused", "dense"])
    p.add_argument("--loops", nargs="+", default=["pipeline", "plain"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    add_link_argument(p)
    bench = p.parse_args(argv)
    if relaunch_under_link("benchmarks.dlrm", bench.link, argv):
        return
    port = _free_port()
    mp.spawn(_worker, args=(bench.world_size, port, bench), nprocs=bench.world_size, join=True)


if __name__ == "__main__":
    main()
