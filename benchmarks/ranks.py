"""Fresh gloo rank processes for one benchmark run, each pinned to its own cores.

Plain torch on purpose: `benchmarks/torchrec_ebc.py.txt` runs its ranks with it too, so both
sides of the TorchRec comparison start, pin and time their ranks the same way.

Ranks fork from a server that has imported `preload` once, so a fresh group starts in about
a second. Every run gets fresh processes: whatever a run leaves in memory cannot pile up.
Each rank sees torchrun's `LOCAL_RANK` / `LOCAL_WORLD_SIZE` for the host layout asked for
(`local_world_size` ranks per simulated host), which is what the sharder reads for its topology.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

DEFAULT_PRELOAD = ("torch", "torch.distributed", "fbgemm_gpu", "recshard")


def rank_cpus(rank: int, threads: int) -> List[int]:
    """The CPUs rank `rank` is pinned to: the next `threads` allowed ones, wrapping around."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[(rank * threads + i) % len(cpus)] for i in range(threads)]


def _rank_main(rank: int, world_size: int, local_world_size: int, port: int,
               args: argparse.Namespace, fn: Callable[..., Any], fn_args: tuple,
               queue: Any) -> None:
    # as torchrun sets them: `ShardingEnv` reads the ranks per host from LOCAL_WORLD_SIZE
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    os.environ["LOCAL_RANK"] = str(rank % local_world_size)
    torch.set_num_threads(args.threads)
    if args.pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(rank_cpus(rank, args.threads)))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=args.timeout))
        queue.put((rank, True, fn(*fn_args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, args: argparse.Namespace, fn: Callable[..., Any],
              *fn_args: Any, start_method: str = "forkserver",
              preload: Sequence[str] = DEFAULT_PRELOAD,
              local_world_size: Optional[int] = None) -> List[Any]:
    """`fn(*fn_args)` on `world_size` fresh gloo ranks; their results in rank order.

    `args` needs `threads` (torch threads per rank), `pin` and `timeout` (seconds).
    `local_world_size`: ranks per simulated host (default: all on one host), set in each
    rank's `LOCAL_WORLD_SIZE` / `LOCAL_RANK` as torchrun would.
    """
    local_world_size = local_world_size or world_size
    if world_size % local_world_size != 0:
        raise ValueError(f"local_world_size {local_world_size} must divide world_size "
                         f"{world_size}")
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(list(preload))
    queue = context.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [context.Process(target=_rank_main, daemon=True,
                             args=(rank, world_size, local_world_size, port, args, fn, fn_args,
                                   queue))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: is a rank gone (killed, e.g. out of memory)?
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RuntimeError(f"{fn.__name__}{fn_args[:1]}: ranks died or timed out "
                                       f"(exit codes {codes})") from None
                continue
            if not ok:
                raise RuntimeError(f"{fn.__name__}{fn_args[:1]}: rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]


def launched_ranks(world_size: int, args: argparse.Namespace, fn: Callable[..., Any],
                   *fn_args: Any) -> List[Any]:
    """Under torchrun: `fn(*fn_args)` on this rank of the launched group; every rank's
    result in rank order (the same signature as `run_ranks`)."""
    results: List[Any] = [None] * world_size
    dist.all_gather_object(results, fn(*fn_args))
    return results


def warm_up(step: Callable[[int], None], warmup: int) -> None:
    """`warmup` untimed calls (`step(i)` runs step i), then a barrier: timing starts together."""
    for i in range(warmup):
        step(i)
    dist.barrier()


def minor_faults() -> int:
    """Page faults of this process so far that needed no disk (fresh pages touched)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_steps(step: Callable[[int], None], steps: int) -> List[float]:
    """The seconds of each of `steps` calls `step(i)`."""
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    return times
