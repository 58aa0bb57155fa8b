"""Run a function on N real processes joined by a gloo process group on 127.0.0.1.

`run_ranks(world_size, fn, *args, timeout=...)` returns each rank's result, in rank order.
A rank that raises makes the call raise with that rank's traceback; a rank still running at
the timeout is killed, so a broken collective fails the test instead of hanging the run. A
rank that reported (returned or raised) but then exits non-zero (an abort at interpreter exit)
fails the call too, naming that exit code.

Processes come from a forkserver that has already imported torch, fbgemm and every recshard
module the test process had imported when the first group started (the test modules' imports,
after collection), so a rank imports neither again: a group starts in well under a second
instead of the 10-20 s a fresh interpreter needs, or the 2-5 s that `recshard.distributed`
alone (torch.distributed.optim, FSDP, DTensor) costs each rank of each call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Sequence

_PRELOAD = ["torch", "torch.distributed", "recshard"]
try:  # fbgemm is optional: the library runs without it
    import fbgemm_gpu  # noqa: F401

    _PRELOAD.insert(1, "fbgemm_gpu")
except Exception:  # pragma: no cover - depends on the machine
    pass

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(_PRELOAD)
# third-party modules the test modules import (pytest, hypothesis): side-effect free to preload
_TEST_DEPENDENCIES = ("pytest", "hypothesis")

PG_TIMEOUT_S = 60.0


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""

    def rank_text(self, rank: int) -> str:
        """Rank `rank`'s report inside the message."""
        text = str(self)
        if text.startswith(f"rank {rank} failed:"):
            return text.split("\n--- rank ", 1)[0]
        marker = f"--- rank {rank} ---\n"
        assert marker in text, f"the harness did not report rank {rank}:\n{text}"
        return text.split(marker, 1)[1].split("\n--- rank ", 1)[0]


def _preload_what_is_imported() -> None:
    """Before the forkserver starts (a no-op after): preload the recshard modules and test
    dependencies this process has imported. Test modules themselves are left out: some call
    `fbgemm_available()` at import, which must see the rank's environment, not the server's."""
    loaded = [
        name
        for name in sys.modules
        if name.startswith("recshard.") and not name.endswith("__main__")
    ]
    extra = [name for name in _TEST_DEPENDENCIES if name in sys.modules]
    _CTX.set_forkserver_preload(_PRELOAD + sorted(loaded) + extra)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    env: Dict[str, str],
    pg_timeout_s: float,
    backend: str,
    queue: Any,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    env: Dict[str, str] | None = None,
    pg_timeout_s: float = PG_TIMEOUT_S,
    backend: str = "gloo",
    may_die: Sequence[int] = (),
) -> List[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return results by rank.

    `fn` must be a module-level function and its arguments and result picklable.
    `env` is added to each rank's environment (e.g. LOCAL_WORLD_SIZE); `backend` is the
    process group's ("nccl" for the CUDA tests). A rank in `may_die` that exits without
    reporting gives `("exited", exit code)` as its result, not an error.
    """
    _preload_what_is_imported()
    queue = _CTX.Queue()
    port = free_port()
    procs = [
        _CTX.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, env or {}, pg_timeout_s, backend, queue),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                detail = "".join(f"\n--- rank {r} ---\n{t}" for r, t in sorted(errors.items()))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s{detail}")
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode is not None
                    and (p.exitcode != 0 or r in may_die)
                    and r not in results
                    and r not in errors
                ]
                for r in dead:
                    if r in may_die:
                        results[r] = ("exited", procs[r].exitcode)
                    else:
                        errors[r] = f"process exited with code {procs[r].exitcode}"
                continue
            (results if ok else errors)[rank] = payload
            if errors:
                # Give the others a moment to report (they usually fail in the same
                # collective), then stop waiting: the first error is what matters.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        reported = set(results) | {
            r for r, t in errors.items() if not t.startswith("process exited")
        }
        for r, p in enumerate(procs):
            p.join(timeout=5.0 if r in reported or not errors else 0.5)  # stuck ranks: kill
            if p.is_alive():
                p.kill()
                p.join()
            elif p.exitcode != 0 and r in reported and r not in may_die:
                # reported (a result or a handled error), then died at exit: an abort in a
                # destructor, e.g. "terminate called without an active exception" (-6)
                how = "returned" if r in results else "raised"
                exit_note = f"{how}, then exited with code {p.exitcode} at interpreter exit"
                errors[r] = exit_note if r in results else f"{errors[r]}\n{exit_note}"
    if errors:
        first = next(iter(errors))  # the first to arrive is the cause; the rest followed it
        others = "".join(f"\n--- rank {r} ---\n{t}" for r, t in errors.items() if r != first)
        raise RankError(f"rank {first} failed:\n{errors[first]}{others}")
    return [results[r] for r in range(world_size)]
