"""One torchrun rank that runs `benchmarks.ranks.launched_fresh_ranks` twice, on any hosts.

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        tests/cluster/fresh_ranks_worker.py OUT_DIR

Each fresh rank reports who it is and sums its rank over its own group; rank 0 writes both
runs' reports and the launched ranks' pids and hosts to OUT_DIR/fresh.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Dict

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks/

from benchmarks.ranks import launched_fresh_ranks  # noqa: E402


def report(tag: str) -> Dict[str, object]:
    """This fresh rank: its group's rank and size, process, host layout, and a collective's sum."""
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dict(
        tag=tag,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        pid=os.getpid(),
        host=socket.gethostname(),
        local_rank=os.environ["LOCAL_RANK"],
        local_world_size=os.environ["LOCAL_WORLD_SIZE"],
        rank_sum=total.item(),
    )


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    args = argparse.Namespace(threads=1, pin=False, timeout=120.0)
    world, local = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    runs = [
        launched_fresh_ranks(world, args, report, tag, local_world_size=local)
        for tag in ("first", "second")
    ]
    launched = [None] * world
    dist.all_gather_object(launched, dict(pid=os.getpid(), host=socket.gethostname()))
    if dist.get_rank() == 0:
        Path(sys.argv[1], "fresh.json").write_text(json.dumps(dict(runs=runs, launched=launched)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
