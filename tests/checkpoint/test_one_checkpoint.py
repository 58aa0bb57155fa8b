"""Every rank loads the same checkpoint, or none does.

Ranks pointed at different checkpoints, or a `LATEST` that changes between two ranks' reads
(a save committing during the load), must raise on every rank before anything is loaded.
A byte-identical copy of the same checkpoint at another path is the same checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict

import torch.distributed as dist
from ckpt_cases import state_bytes, trained
from multiprocess import run_ranks

from recshard import checkpoint


def _try_load(path: str, target, target_opt, before) -> str:  # noqa: ANN001
    try:
        checkpoint.load(path, target, target_opt)
        return "loaded"
    except ValueError as e:
        assert state_bytes(target, target_opt) == before, "state changed"
        return str(e)


def _loads(rank: int, ws: int, root: str) -> Dict[str, str]:
    a, b, copy = (os.path.join(root, n) for n in ("a", "b", "copy"))
    model, opt = trained(ws, rank, seed=0, steps=1)
    older = Path(checkpoint.save(a, model, opt, extra={"save": "a1"}))
    checkpoint.save(a, model, opt, extra={"save": "a2"})  # a: LATEST names a2, a1 is kept
    checkpoint.save(b, model, opt, extra={"save": "b"})
    target, target_opt = trained(ws, rank, seed=1, steps=1)
    before = state_bytes(target, target_opt)
    out: Dict[str, str] = {}
    dist.barrier()
    out["different"] = _try_load(a if rank == 0 else b, target, target_opt, before)
    dist.barrier()
    if rank == 1:  # rank 0 has read LATEST (a2) and waits for rank 1 in the load
        time.sleep(3.0)
        Path(a, "LATEST").write_text(older.name)
    out["latest_changed"] = _try_load(a, target, target_opt, before)
    dist.barrier()
    if rank == 0:
        shutil.copytree(a, copy)
    dist.barrier()
    out["copy"] = str(checkpoint.load(a if rank == 0 else copy, target, target_opt))
    return out


def test_ranks_reading_different_checkpoints_all_raise() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(2, _loads, root, timeout=120, pg_timeout_s=30)
    for rank, out in enumerate(results):
        for case in ("different", "latest_changed"):
            text = out[case]
            assert "ranks are loading different checkpoints" in text, (rank, case, text)
            assert "rank 0 reads" in text and "rank 1 reads" in text, (rank, case, text)
        assert out["copy"] == "{'save': 'a1'}", out
