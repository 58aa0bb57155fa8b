"""Launch the stock `torchrun` on every host of a simulated cluster and collect the outcome.

Each host runs the same command line, as on real machines: `torchrun --nnodes H
--nproc_per_node N --rdzv-backend c10d --rdzv-endpoint host0:PORT ...`; torchrun assigns node
ranks and sets `LOCAL_WORLD_SIZE`. Output goes to one log file per host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

from scripts.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@dataclass
class Job:
    """One torchrun agent per host; `logs[i]` is host i's output."""

    processes: List[subprocess.Popen]
    logs: List[Path]

    def wait(self, timeout: float) -> List[int]:
        """Exit codes in host order; a job still running at `timeout` is killed, and the
        error holds every host's log."""
        deadline = time.monotonic() + timeout
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                self.kill()
                raise TimeoutError(
                    f"torchrun did not finish within {timeout:.0f}s\n{self.output()}"
                ) from None
        return codes

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def output(self, host: int | None = None) -> str:
        hosts = range(len(self.logs)) if host is None else [host]
        return "".join(f"----- host{h} -----\n{self.logs[h].read_text()}\n" for h in hosts)


def torchrun(
    cluster: Cluster,
    target: Sequence[str],
    logs: Path,
    *,
    nproc: int = 2,
    port: int = 29500,
    flags: Sequence[str] = (),
    env: Dict[str, str] | None = None,
) -> Job:
    """Start `torchrun ... TARGET` on every host (`target`: `-m module args` or a script)."""
    argv = [
        TORCHRUN,
        "--nnodes",
        str(len(cluster.members)),
        "--nproc_per_node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"host0:{port}",
        *flags,
        *target,
    ]
    # torchrun's shared rendezvous store keeps the last attempt's keys, so restarted gloo
    # groups dial dead peers (pytorch#135712): a fresh store per attempt avoids that.
    environment = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        **(env or {}),
    }
    logs.mkdir(parents=True, exist_ok=True)
    processes, files = [], []
    for host in cluster.members:
        log = logs / f"{host.name}.log"
        with open(log, "w") as out:
            processes.append(
                cluster.popen(
                    host.index,
                    argv,
                    cwd=str(ROOT),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=environment,
                )
            )
        files.append(log)
    return Job(processes, files)


def children(pid: int) -> List[int]:
    """The processes whose parent is `pid` (torchrun's workers, for the agent's pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its closing paren
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)
