"""Run a Python script in a fresh interpreter with this checkout first on its path: for tests
whose subject aborts or limits the whole process (an interpreter exit, an address-space cap, a
file-size limit), which must not take the test run with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -c script args...` with the checkout on PYTHONPATH; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
