"""Benchmarks on a shaped link: `--link RATE` re-runs the benchmark under `slowlink`, and a clock
adds up the time a step waits on collectives.

`../shared/tools/slowlink RATE CMD` runs CMD in a private network namespace whose loopback is
shaped to RATE by `tc tbf`, so every rank's traffic crosses one link of that bandwidth (needs
root, `unshare`, `tc`). A benchmark calls `relaunch_under_link(module, args.link)` first: with a
rate, the parent re-runs `python -m module ARGS` under slowlink (the child sees `RECSHARD_LINK`
and checks the qdisc is in place) and the parent only waits. Every JSON line then carries
`link`: the rate, or "unshaped".

`CollectiveWaitClock` splits what a step spends blocked in recshard's collective waits
(`recshard.comm.request.wait_work`, which every embedding collective waits through) into the
KJT all-to-alls (input dist, by name), the pooled collectives waited in forward (output dist),
and those waited in backward (their transposes, told apart by torch's current autograd graph
task: -1 outside backward).
DDP's gradient all-reduce does not go through `wait_work` and is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import recshard.comm.kjt as kjt_a2a
import recshard.comm.request as request

LINK_ENV = "RECSHARD_LINK"
UNSHAPED = "unshaped"
ROOT = Path(__file__).resolve().parents[1]
SLOWLINK = ROOT.parent / "shared" / "tools" / "slowlink"
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")


def add_link_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="re-run under ../shared/tools/slowlink with the loopback shaped to "
        "RATE (tc units: 1gbit, 500mbit); default: the unshaped loopback",
    )


def slowlink_missing() -> str | None:
    """Why slowlink cannot run here (None: it can)."""
    if not SLOWLINK.is_file():
        return f"{SLOWLINK} not found"
    if os.geteuid() != 0:
        return "slowlink needs root (a private network namespace and tc)"
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (apt-get install iproute2 util-linux)"
    return None


def loopback_bytes() -> int:
    """Bytes sent over this network namespace's loopback so far (`/proc/net/dev`): under
    slowlink, every byte that crossed the shaped link, from every rank, headers included."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # transmit bytes
    raise RuntimeError("no loopback device in /proc/net/dev")


def link_label() -> str:
    """The rate this process's loopback is shaped to, or "unshaped"."""
    return os.environ.get(LINK_ENV, UNSHAPED)


def emit(record: Dict[str, object]) -> None:
    """One JSON line on stdout (rank 0's only, under torchrun), with the link it ran on."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({**record, "link": link_label()}), flush=True)


def _check_shaped(rate: str) -> None:
    """In the re-run child: the loopback must carry slowlink's tbf qdisc."""
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    if "tbf" not in shown.stdout:
        raise SystemExit(
            f"--link {rate}: {LINK_ENV} is set but the loopback has no tbf qdisc "
            f"({shown.stdout.strip() or shown.stderr.strip()!r})"
        )


def relaunch_under_link(module: str, link: str | None, argv: List[str] | None = None) -> bool:
    """With `link`, re-run `python -m module argv` under slowlink and return True once it has
    finished (the caller then returns); False when there is nothing to do (no `link`, or this
    is the re-run child). Exits with the child's status when it fails."""
    if link is None:
        if os.environ.get(LINK_ENV):
            raise SystemExit(f"{LINK_ENV}={os.environ[LINK_ENV]} is set but --link is not given")
        return False
    if not _RATE.match(link):
        raise SystemExit(f"--link {link!r}: expected a tc rate such as 1gbit, 2.5gbit or 500mbit")
    if os.environ.get(LINK_ENV) == link:
        _check_shaped(link)
        return False
    if "RANK" in os.environ:
        raise SystemExit(
            f"--link {link} under torchrun: run torchrun itself under slowlink "
            f"with {LINK_ENV}={link} set"
        )
    missing = slowlink_missing()
    if missing is not None:
        raise SystemExit(f"--link {link}: {missing}")
    args = sys.argv[1:] if argv is None else argv
    command = [str(SLOWLINK), link, sys.executable, "-m", module, *args]
    status = subprocess.run(command, cwd=ROOT, env={**os.environ, LINK_ENV: link}).returncode
    if status != 0:
        raise SystemExit(status)
    return True


@dataclass
class WaitTimes:
    """Milliseconds blocked in collective waits, by kind."""

    kjt: float = 0.0
    pooled_forward: float = 0.0
    backward: float = 0.0

    @property
    def total(self) -> float:
        return self.kjt + self.pooled_forward + self.backward

    def shares(self, step_ms: float) -> Dict[str, float]:
        """Each kind's share of `step_ms` (and their sum), rounded for a JSON line."""
        parts = {
            "kjt": self.kjt,
            "pooled_forward": self.pooled_forward,
            "backward": self.backward,
            "total": self.total,
        }
        return {k: round(v / step_ms, 3) for k, v in parts.items()}

    def per_step(self, steps: int) -> WaitTimes:
        return WaitTimes(self.kjt / steps, self.pooled_forward / steps, self.backward / steps)


class CollectiveWaitClock:
    """Times every `wait_work` call (see the module docstring) while installed."""

    _MODULES = (request, kjt_a2a)

    def __init__(self) -> None:
        self.times = WaitTimes()
        self._original: Callable[..., None] = request.wait_work
        for module in self._MODULES:
            module.wait_work = self._timed_wait  # type: ignore[attr-defined]

    def _timed_wait(self, work: Any, name: str, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            self._original(work, name, *args, **kwargs)
        finally:
            ms = 1e3 * (time.perf_counter() - start)
            if name.startswith("kjt_"):
                self.times.kjt += ms
            elif torch._C._current_graph_task_id() != -1:  # inside autograd's backward
                self.times.backward += ms
            else:
                self.times.pooled_forward += ms

    def take(self) -> WaitTimes:
        """The times since the last `take`, and start over."""
        times, self.times = self.times, WaitTimes()
        return times

    def close(self) -> None:
        for module in self._MODULES:
            module.wait_work = self._original  # type: ignore[attr-defined]
