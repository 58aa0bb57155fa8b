"""Run a benchmark's `main(args)` on gloo ranks: in this process under torchrun, otherwise
on `world_size` spawned processes on 127.0.0.1 (one torch thread each unless told)."""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

Main = Callable[[argparse.Namespace], None]
TIMEOUT = timedelta(seconds=300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(main: Main, args: argparse.Namespace, threads: int, **init: object) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(timeout=TIMEOUT, **init)
    try:
        main(args)
    finally:
        dist.destroy_process_group()


def _worker(
    rank: int, world_size: int, port: int, main: Main, args: argparse.Namespace, threads: int
) -> None:
    _run(
        main,
        args,
        threads,
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )


def run_on_ranks(main: Main, args: argparse.Namespace, world_size: int, threads: int = 1) -> None:
    """`main` must be a module-level function (spawned processes import it)."""
    if "RANK" in os.environ:  # launched by torchrun
        _run(main, args, threads)
        return
    torch.multiprocessing.spawn(
        _worker, args=(world_size, free_port(), main, args, threads), nprocs=world_size, join=True
    )
