"""Running a calibration probe in a fresh process (`python -m recshard.calibration.probe NAME
ARG...`): memory probes measure a process's resident growth, which a process that already
holds freed memory in its allocator, or has already touched the code, would hide."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any, Sequence

logger = logging.getLogger(__name__)

TIMEOUT_S = 300.0


def start(name: str, args: Sequence[int]) -> subprocess.Popen:
    """Start probe `name` with integer `args` in a fresh one-thread process."""
    return subprocess.Popen(
        [sys.executable, "-m", "recshard.calibration.probe", name, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def result(proc: subprocess.Popen, what: str) -> Any | None:
    """The JSON value a started probe printed last; None (logged as `what` not measured)
    when it failed (not Linux, /proc not writable, ...)."""
    out, err = proc.communicate(timeout=TIMEOUT_S)
    if proc.returncode != 0:
        logger.warning("%s not measured: %s", what, err.strip()[-500:])
        return None
    return json.loads(out.strip().splitlines()[-1])


def run(name: str, args: Sequence[int], what: str) -> Any | None:
    """`start` probe `name` and wait for its `result`."""
    return result(start(name, args), what)
