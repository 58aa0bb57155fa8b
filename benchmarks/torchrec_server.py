"""TorchRec's side of a side-by-side benchmark: a TorchRec venv's python serving runs.

Plain Python on purpose (no recshard, no torch): the benchmarks that compare with TorchRec
(compare_torchrec.py, dlrm_compare.py, vbe.py, position_weighted.py) start one `side` script
(a `torchrec_*.py.txt`) under VENV's python and send it one JSON request per run; it answers
one `RESULT {json}` line with every rank's result.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Dict, List


class TorchRecServer:
    """TorchRec's side: one long-lived VENV python running `side`, one run per request."""

    def __init__(self, venv: Path, side: Path) -> None:
        python = venv / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"--venv {venv}: no {python} (recipe in ../shared/TARGETS.md)")
        self._proc = subprocess.Popen(
            [str(python), str(side)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=side.parent,
        )

    def run(self, request: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Every rank's result of one run."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith("RESULT "):
                reply = json.loads(line[len("RESULT ") :])
                if not reply["ok"]:
                    raise RuntimeError(f"TorchRec side failed on {request}:\n{reply['error']}")
                return reply["ranks"]
        raise RuntimeError(f"TorchRec side exited ({self._proc.wait()}) on {request}")

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=60)


def emit(record: Dict[str, object]) -> None:
    """One JSON line on stdout."""
    print(json.dumps(record), flush=True)
