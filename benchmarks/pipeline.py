"""Step time of TrainPipelineSparseDist and TrainPipelineSemiSync vs the plain loop, on a model
whose input all-to-all is a large share of the step. Prints JSON lines.

    python -m benchmarks.pipeline                    # spawns 2 gloo ranks on this machine
    python -m benchmarks.pipeline --quick            # smaller, fewer blocks
    python -m benchmarks.pipeline --link 1gbit       # on a loopback shaped to 1 Gbit/s
    torchrun --nproc-per-node 2 -m benchmarks.pipeline

Four DMP models are built from the same seed and plan (tables table-wise, alternating ranks,
fused SGD): one trained by the plain loop (`zero_grad, forward, backward, step`), one by
`TrainPipelineSparseDist` (`pipelined`), one by `TrainPipelineSemiSync(start_batch=0)`
(`semi_sync`) and one by `semi_sync_reference`, the plain loop with the semi-sync staleness
(batch i+1's embeddings looked up after batch i's forward, before its sparse update). Timed
blocks of `--steps` steps rotate through the loops (the order shifts by one every block), so
load on the machine hits all alike; a block ends when every collective it issued has completed
(a gloo barrier waits for them), so a pipeline's look-ahead left in flight is paid by its own
block; a block's time is the slowest rank's, and the lines report medians over blocks of ms per
step (`*_over_plain_paired`: the median of the per-block ratios, robust to load drifting
between blocks). `*_cpu_ms` is rank 0's process CPU time per step (all threads): when it is close
to the wall time, the ranks are CPU-bound and overlap has no idle core to use. `input_dist_ms` is
the input dist alone (both all-to-all stages plus their host work) of one batch, and
`input_dist_fraction` its share of the plain step. `link_mb_per_step`: MB per step sent over
the loopback by both ranks (`/proc/net/dev`, headers included; under `--link`, what crossed the
shaped link); `plain_payload_mb_per_step`: what rank 0 handed to each collective per plain step
(its own chunk of an all-to-all included, which does not cross the link).
`plain_forward_all_to_all_ms` is what the plain loop's forward spends in its all-to-alls (input dist
issue and waits, output dist wait; rank 0's clock), the share the target's ">= 30% of the step"
refers to. `wait_share` is each loop's time blocked in collective waits per step
(`benchmarks/link.py`: KJT all-to-alls, pooled forward, backward) over its step; `losses_identical`
compares the two loops' per-step losses bit for bit, `semi_sync_losses_identical` the semi-sync
pipeline's against its reference's (the stale plain loop). The model: 26 tables with the Criteo
Kaggle cardinalities capped at `--rows`, multi-hot bags (mean `--pooling` ids) of narrow rows, so
the input dist is the big all-to-all. `--link RATE` re-runs the benchmark on a shaped loopback
(`link` field); `--pooled-precision fp16|bf16` sends the pooled all-to-all in that dtype in every
loop. Batches are generated before timing and reused cyclically. A first line checks that a started
input dist progresses while the main thread computes (gloo runs collectives on worker threads).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.launch import run_on_ranks
from benchmarks.link import (
    CollectiveWaitClock,
    WaitTimes,
    add_link_argument,
    link_label,
    loopback_bytes,
    relaunch_under_link,
)
from benchmarks.pipeline_model import Batch, build, make_batches
from recshard import KeyedJaggedTensor, KeyedTensor
from recshard.comm.request import comm_payload_bytes, reset_comm_payload_bytes
from recshard.distributed import DistributedModelParallel
from recshard.distributed.train_pipeline import TrainPipelineSemiSync, TrainPipelineSparseDist

LOOPS = ["plain", "pipelined", "semi_sync", "semi_sync_reference"]


class _CommClock:
    """Adds up the time the plain model's forward spends in its EBC's all-to-alls: issuing the
    input dist (host work included), waiting for its two stages, and waiting for the output dist.
    (The backward all-to-all and DDP's all-reduce are not counted.)"""

    def __init__(self, ebc: nn.Module) -> None:
        self.ms = 0.0
        input_dist, output_dist = ebc.input_dist, ebc.output_dist

        def timed_input_dist(ctx: Any, features: KeyedJaggedTensor) -> Any:
            return self._timed(lambda: self._wrap(input_dist(ctx, features), depth=2))

        def timed_output_dist(ctx: Any, output: Any) -> Any:
            return self._wrap(output_dist(ctx, output), depth=1)

        ebc.input_dist, ebc.output_dist = timed_input_dist, timed_output_dist

    def _timed(self, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        self.ms += 1e3 * (time.perf_counter() - start)
        return result

    def _wrap(self, awaitable: Any, depth: int) -> Any:
        """Time `awaitable.wait()` (and, for depth 2, the wait of the awaitable it returns)."""
        wait = awaitable.wait
        if depth == 2:
            awaitable.wait = lambda: self._wrap(self._timed(wait), depth=1)
        else:
            awaitable.wait = lambda: self._timed(wait)
        return awaitable


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _time_block(run_step: Callable[[], Any], steps: int) -> Tuple[float, float]:
    """ms per step of `steps` steps (the slowest rank's wall time, up to the completion of every
    collective the steps issued: gloo's barrier waits for all work issued before it), and this
    process's CPU ms per step (all its threads: main, gloo workers)."""
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        run_step()
    dist.barrier()
    cpu = time.process_time() - cpu_start
    return 1e3 * _slowest(time.perf_counter() - start) / steps, 1e3 * cpu / steps


class StaleReference:
    """The plain loop with TrainPipelineSemiSync's staleness (start_batch 0): batch i+1's
    embeddings are looked up after batch i's forward and before its backward, so without batch
    i's sparse update; the dense model trains on a detached copy whose gradient then runs the
    embeddings' backward."""

    def __init__(
        self, model: DistributedModelParallel, optimizer: Any, batches: Iterator[Batch]
    ) -> None:
        self._model, self._optimizer, self._batches = model, optimizer, batches
        self._ebc = model.module.ebc
        self._next: Tuple[Batch, KeyedTensor] | None = None

    def _lookup(self) -> Tuple[Batch, KeyedTensor]:
        batch = next(self._batches)
        return batch, self._ebc(batch.sparse_features).wait()

    def step(self) -> float:
        batch, embeddings = self._next or self._lookup()
        leaf = embeddings.values().detach().requires_grad_()
        detached = KeyedTensor(embeddings.keys(), embeddings.length_per_key(), leaf)
        self._optimizer.zero_grad()
        self._ebc.forward = lambda *_: detached
        try:
            loss, _ = self._model(batch)
        finally:
            del self._ebc.forward
        self._next = self._lookup()
        loss.backward()
        embeddings.values().backward(leaf.grad)
        self._optimizer.step()
        return loss.item()


def run(args: argparse.Namespace) -> Dict[str, Any]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    pool = make_batches(args, rank)
    plain_model, plain_opt = build(args, world_size)
    piped_model, piped_opt = build(args, world_size)
    pipeline = TrainPipelineSparseDist(piped_model, piped_opt, torch.device("cpu"))
    semi_model, semi_opt = build(args, world_size)
    semi_sync = TrainPipelineSemiSync(semi_model, semi_opt, torch.device("cpu"), start_batch=0)
    stale_model, stale_opt = build(args, world_size)
    stale = StaleReference(stale_model, stale_opt, itertools.cycle(pool))
    plain_iter: Iterator[Batch] = itertools.cycle(pool)
    piped_iter: Iterator[Batch] = itertools.cycle(pool)
    semi_iter: Iterator[Batch] = itertools.cycle(pool)
    losses: Dict[str, List[float]] = {k: [] for k in LOOPS}

    def plain_step() -> None:
        batch = next(plain_iter)
        plain_opt.zero_grad()
        loss, _ = plain_model(batch)
        loss.backward()
        plain_opt.step()
        losses["plain"].append(loss.item())

    def piped_step() -> None:
        loss, _ = pipeline.progress(piped_iter)
        losses["pipelined"].append(loss.item())

    def semi_step() -> None:
        loss, _ = semi_sync.progress(semi_iter)
        losses["semi_sync"].append(loss.item())

    def stale_step() -> None:
        losses["semi_sync_reference"].append(stale.step())

    ebc = plain_model.module.ebc

    def input_dist() -> None:
        ebc.input_dist(ebc.create_context(), pool[0].sparse_features).wait().wait()

    steps = {
        "plain": plain_step,
        "pipelined": piped_step,
        "semi_sync": semi_step,
        "semi_sync_reference": stale_step,
    }
    for _ in range(args.warmup):
        for step_fn in steps.values():
            step_fn()
        input_dist()
    clock = _CommClock(ebc)
    waits = CollectiveWaitClock()
    wall: Dict[str, List[float]] = {k: [] for k in [*LOOPS, "input_dist"]}
    cpu: Dict[str, List[float]] = {k: [] for k in wall}
    wait: Dict[str, List[WaitTimes]] = {k: [] for k in wall}
    comm_ms: List[float] = []
    link_mb: Dict[str, List[float]] = {k: [] for k in wall}
    payload_mb: Dict[str, float] = {}
    for block in range(args.blocks):
        shift = block % len(LOOPS)
        order = [(k, steps[k]) for k in LOOPS[shift:] + LOOPS[:shift]]
        for name, step_fn in order + [("input_dist", input_dist)]:
            clock.ms = 0.0
            waits.take()
            reset_comm_payload_bytes()
            sent = loopback_bytes()
            block_wall, block_cpu = _time_block(step_fn, args.steps)
            link_mb[name].append((loopback_bytes() - sent) / 1e6 / args.steps)
            wall[name].append(block_wall)
            cpu[name].append(block_cpu)
            wait[name].append(waits.take().per_step(args.steps))
            if name == "plain":
                comm_ms.append(clock.ms / args.steps)
                payload_mb = {
                    k: round(v / 1e6 / args.steps, 3) for k, v in comm_payload_bytes().items()
                }
    waits.close()
    plain, piped, semi, ref, in_dist = (statistics.median(wall[k]) for k in [*LOOPS, "input_dist"])
    in_step_comm = statistics.median(comm_ms)

    def paired(name: str) -> float:
        return round(statistics.median(p / q for p, q in zip(wall[name], wall["plain"])), 3)

    ids = sum(b.sparse_features.values().numel() for b in pool) / len(pool)
    return {
        "bench": "train_pipeline",
        "link": link_label(),
        "world_size": world_size,
        "backend": dist.get_backend(),
        "torch_threads": torch.get_num_threads(),
        "batch_size_per_rank": args.batch_size,
        "features": args.features,
        "mean_pooling": args.pooling,
        "dim": args.dim,
        "pooled_precision": args.pooled_precision,
        "ids_per_rank_per_batch": int(ids),
        "steps_per_block": args.steps,
        "blocks": args.blocks,
        "plain_ms": round(plain, 3),
        "pipelined_ms": round(piped, 3),
        "semi_sync_ms": round(semi, 3),
        "semi_sync_reference_ms": round(ref, 3),
        "pipelined_over_plain": round(piped / plain, 3),
        "pipelined_over_plain_paired": paired("pipelined"),
        "semi_sync_over_plain": round(semi / plain, 3),
        "semi_sync_over_plain_paired": paired("semi_sync"),
        **{
            f"{k}_samples_per_s": round(
                world_size * args.batch_size * 1e3 / statistics.median(wall[k])
            )
            for k in LOOPS
        },
        "losses_identical": losses["plain"] == losses["pipelined"],
        "semi_sync_losses_identical": losses["semi_sync"] == losses["semi_sync_reference"],
        "steps_compared": len(losses["plain"]),
        **{f"{k}_wait_share": _median_shares(wait[k], wall[k]) for k in LOOPS},
        **{f"{k}_cpu_ms": round(statistics.median(cpu[k]), 3) for k in LOOPS},
        "input_dist_ms": round(in_dist, 3),
        "input_dist_fraction": round(in_dist / plain, 3),
        "plain_forward_all_to_all_ms": round(in_step_comm, 3),
        "plain_forward_all_to_all_fraction": round(in_step_comm / plain, 3),
        "link_mb_per_step": {k: round(statistics.median(v), 3) for k, v in link_mb.items()},
        "plain_payload_mb_per_step": payload_mb,
        "pipelined_modules": pipeline.pipelined_modules,
        "plain_ms_blocks": [round(x, 2) for x in wall["plain"]],
        "pipelined_ms_blocks": [round(x, 2) for x in wall["pipelined"]],
        "semi_sync_ms_blocks": [round(x, 2) for x in wall["semi_sync"]],
        "load_average_1min": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
    }


def _median_shares(waits: List[WaitTimes], step_ms: List[float]) -> Dict[str, float]:
    """Per kind, the median over blocks of its wait share of the block's step."""
    shares = [w.shares(ms) for w, ms in zip(waits, step_ms)]
    return {k: statistics.median(s[k] for s in shares) for k in shares[0]}


def _busy(ms: float) -> None:
    """Keep the main thread computing (GIL released inside the matmuls) for `ms`."""
    start, a = time.perf_counter(), torch.randn(128, 128)
    while 1e3 * (time.perf_counter() - start) < ms:
        a = torch.tanh(a @ a)


def background_progress(args: argparse.Namespace, repeats: int = 5) -> Dict[str, Any]:
    """Does a started input dist move while the main thread computes (gloo's worker threads)?

    Runs the two stages of one input dist back to back (`serial`: issue, wait, wait), then with
    `busy_ms` of compute after each stage, as the pipeline schedules them. If the all-to-alls
    progress in the background, the waits after compute take ~0 ms.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, _ = build(args, world_size)
    ebc, kjt = model.module.ebc, make_batches(args, rank)[0].sparse_features
    serial, overlapped = [], []
    for _ in range(repeats):
        for busy_ms, out in ((0.0, serial), (args.busy_ms, overlapped)):
            dist.barrier()
            t0 = time.perf_counter()
            splits = ebc.input_dist(ebc.create_context(), kjt)
            t1 = time.perf_counter()
            _busy(busy_ms)
            t2 = time.perf_counter()
            tensors = splits.wait()
            t3 = time.perf_counter()
            _busy(busy_ms)
            t4 = time.perf_counter()
            tensors.wait()
            t5 = time.perf_counter()
            out.append((t1 - t0, t3 - t2, t5 - t4))
    med = [
        [round(1e3 * statistics.median(x[i] for x in runs), 3) for i in range(3)]
        for runs in (serial, overlapped)
    ]
    return {
        "bench": "input_dist_background_progress",
        "link": link_label(),
        "world_size": world_size,
        "ids_per_rank": kjt.values().numel(),
        "busy_ms": args.busy_ms,
        "serial_issue_splits_tensors_ms": med[0],
        "after_compute_issue_splits_tensors_ms": med[1],
    }


def _main(args: argparse.Namespace) -> None:
    results = [background_progress(args), run(args)]
    if dist.get_rank() == 0:
        for result in results:
            print(json.dumps(result), flush=True)


def cli(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--features", type=int, default=26, help="one table per feature")
    p.add_argument("--pooling", type=int, default=32, help="mean ids per feature and sample")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--dense-in", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=7, help="timed blocks per loop (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool", type=int, default=4, help="distinct batches, reused cyclically")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--busy-ms",
        type=float,
        default=50.0,
        help="compute after each input-dist stage in the background-progress probe",
    )
    p.add_argument("--quick", action="store_true", help="smaller batch, fewer blocks")
    p.add_argument(
        "--pooled-precision",
        choices=["fp32", "fp16", "bf16"],
        default="fp32",
        help="dtype of the pooled all-to-all on the wire, both ways (comm codecs); "
        "every loop uses it, so the loops' losses stay comparable",
    )
    add_link_argument(p)
    args = p.parse_args(argv)
    if relaunch_under_link("benchmarks.pipeline", args.link, argv):
        return
    if args.quick:
        args.batch_size, args.steps, args.blocks, args.warmup = 512, 5, 3, 2
    run_on_ranks(_main, args, args.world_size, args.threads)


if __name__ == "__main__":
    cli()
