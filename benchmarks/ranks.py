"""Fresh gloo rank processes for one benchmark run, each pinned to its own cores.

Plain torch on purpose: `benchmarks/torchrec_ebc.py.txt` runs its ranks with it too, so both
sides of the TorchRec comparison start, pin and time their ranks the same way.

Ranks fork from a server that has imported `preload` once, so a fresh group starts in about
a second. Every run gets fresh processes: whatever a run leaves in memory cannot pile up.
Each rank sees torchrun's `LOCAL_RANK` / `LOCAL_WORLD_SIZE` for the host layout asked for
(`local_world_size` ranks per simulated host), which is what the sharder reads for its topology.
Under torchrun, `launched_fresh_ranks` does the same across the job's hosts: each launched rank
starts its rank of the fresh group.
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
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

DEFAULT_PRELOAD = ("torch", "torch.distributed", "fbgemm_gpu", "recshard")


def rank_cpus(rank: int, threads: int) -> List[int]:
    """The CPUs rank `rank` is pinned to: the next `threads` allowed ones, wrapping around."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[(rank * threads + i) % len(cpus)] for i in range(threads)]


def _rank_main(
    rank: int,
    world_size: int,
    local_world_size: int,
    address: str,
    args: argparse.Namespace,
    fn: Callable[..., Any],
    fn_args: tuple,
    queue: Any,
) -> None:
    # as torchrun sets them: `ShardingEnv` reads the ranks per host from LOCAL_WORLD_SIZE
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    os.environ["LOCAL_RANK"] = str(rank % local_world_size)
    torch.set_num_threads(args.threads)
    if args.pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(rank_cpus(rank, args.threads)))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=args.timeout),
        )
        queue.put((rank, True, fn(*fn_args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _spawn(
    ranks: Sequence[int],
    world_size: int,
    local_world_size: int,
    address: str,
    args: argparse.Namespace,
    fn: Callable[..., Any],
    fn_args: tuple,
    start_method: str,
    preload: Sequence[str],
) -> Dict[int, Any]:
    """Start processes for `ranks` of a `world_size` gloo group meeting at `address` (host:port
    of rank 0's store), run `fn(*fn_args)` in each; their results by rank."""
    if world_size % local_world_size != 0:
        raise ValueError(f"local_world_size {local_world_size} must divide world_size {world_size}")
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(list(preload))
    queue = context.Queue()
    procs = {
        rank: context.Process(
            target=_rank_main,
            daemon=True,
            args=(rank, world_size, local_world_size, address, args, fn, fn_args, queue),
        )
        for rank in ranks
    }
    for p in procs.values():
        p.start()
    results: Dict[int, Any] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(results) < len(procs):
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: is a rank gone (killed, e.g. out of memory)?
                dead = [r for r, p in procs.items() if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RuntimeError(
                        f"{fn.__name__}{fn_args[:1]}: ranks died or timed out (exit codes {codes})"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"{fn.__name__}{fn_args[:1]}: rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs.values():
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def run_ranks(
    world_size: int,
    args: argparse.Namespace,
    fn: Callable[..., Any],
    *fn_args: Any,
    start_method: str = "forkserver",
    preload: Sequence[str] = DEFAULT_PRELOAD,
    local_world_size: int | None = None,
) -> List[Any]:
    """`fn(*fn_args)` on `world_size` fresh gloo ranks; their results in rank order.

    `args` needs `threads` (torch threads per rank), `pin` and `timeout` (seconds).
    `local_world_size`: ranks per simulated host (default: all on one host), set in each
    rank's `LOCAL_WORLD_SIZE` / `LOCAL_RANK` as torchrun would.
    """
    results = _spawn(
        range(world_size),
        world_size,
        local_world_size or world_size,
        f"127.0.0.1:{_free_port('127.0.0.1')}",
        args,
        fn,
        fn_args,
        start_method,
        preload,
    )
    return [results[r] for r in range(world_size)]


def launched_fresh_ranks(
    world_size: int,
    args: argparse.Namespace,
    fn: Callable[..., Any],
    *fn_args: Any,
    local_world_size: int | None = None,
) -> List[Any]:
    """Under torchrun, `run_ranks` across the job's hosts: each launched rank starts one fresh
    process as the same rank of a new gloo group (its store on rank 0's host, a port rank 0
    picks), so every run still gets fresh processes; every rank's result in rank order.
    `world_size` and `local_world_size` must be the launched job's."""
    if (world_size, local_world_size) != (
        dist.get_world_size(),
        int(os.environ["LOCAL_WORLD_SIZE"]),
    ):
        raise ValueError(
            f"launched_fresh_ranks runs the launched layout ({dist.get_world_size()}"
            f" ranks, {os.environ['LOCAL_WORLD_SIZE']} a host), not {world_size} "
            f"x {local_world_size}"
        )
    rank = dist.get_rank()
    host = socket.gethostname()  # resolves to this host's address, as torchrun's rendezvous uses
    meeting = [f"{host}:{_free_port(host)}" if rank == 0 else ""]
    dist.broadcast_object_list(meeting, src=0)
    mine = _spawn(
        [rank],
        world_size,
        local_world_size,
        meeting[0],
        args,
        fn,
        fn_args,
        "forkserver",
        DEFAULT_PRELOAD,
    )
    results: List[Any] = [None] * world_size
    dist.all_gather_object(results, mine[rank])
    return results


def launched_ranks(
    world_size: int, args: argparse.Namespace, fn: Callable[..., Any], *fn_args: Any
) -> List[Any]:
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
