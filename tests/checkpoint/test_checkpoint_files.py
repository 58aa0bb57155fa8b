"""Checkpoint files must be regular files inside the checkpoint directory.

Two ranks save; then, one case at a time, rank 0 replaces a file of the checkpoint with a
symlink to an identical copy outside the directory, a FIFO (which a plain open would wait on
forever), a character device, or an oversized `extra.json`. Every rank's load must refuse it
with an error naming the file, within seconds, and leave the model unchanged.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Dict

import torch.distributed as dist
from ckpt_cases import state_bytes, trained
from multiprocess import run_ranks

from recshard import checkpoint


def _can_make_devices(path: str) -> bool:
    try:
        os.mknod(os.path.join(path, "probe"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except OSError:
        return False
    os.remove(os.path.join(path, "probe"))
    return True


def _replace(directory: Path, outside: Path, case: str) -> str:
    """Damage the checkpoint; returns the name of the file replaced."""
    if case == "symlinked_shard":
        name = "__1_0.distcp"
        shutil.copy(directory / name, outside / name)
        os.remove(directory / name)
        os.symlink(outside / name, directory / name)
        return name
    name = {"fifo_manifest": "manifest.json", "fifo_latest": "LATEST"}.get(case, "extra.json")
    file = directory.parent / name if name == "LATEST" else directory / name
    os.remove(file)
    if case.startswith("fifo"):
        os.mkfifo(file)
    elif case == "device_extra":
        os.mknod(file, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
    else:  # oversized_extra: valid JSON past the size cap
        file.write_text("{}" + " " * (64 << 20))
    return name


def _load_each(rank: int, ws: int, path: str, outside: str, cases: list) -> Dict[str, str]:
    root = Path(path)
    model, opt = trained(ws, rank, seed=0, steps=1)
    directory = Path(checkpoint.save(path, model, opt, extra={"step": 1}))
    target, target_opt = trained(ws, rank, seed=1, steps=1)
    before = state_bytes(target, target_opt)
    if rank == 0:
        shutil.copytree(directory, root / "backup")
        shutil.copy(root / "LATEST", root / "LATEST.backup")
    outcome: Dict[str, str] = {}
    for case in cases:
        if rank == 0:
            outcome["name:" + case] = _replace(directory, Path(outside), case)
        dist.barrier()
        try:
            checkpoint.load(path, target, target_opt)
            outcome[case] = "loaded"
        except ValueError as e:
            outcome[case] = str(e)
        assert state_bytes(target, target_opt) == before, f"{case}: state changed"
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
            shutil.copytree(root / "backup", directory)
            os.remove(root / "LATEST")
            shutil.copy(root / "LATEST.backup", root / "LATEST")
        dist.barrier()
    assert checkpoint.load(path, target, target_opt) == {"step": 1}
    return outcome


def test_links_fifos_devices_and_huge_json_are_refused_on_every_rank() -> None:
    cases = ["symlinked_shard", "fifo_manifest", "fifo_extra", "fifo_latest", "oversized_extra"]
    with tempfile.TemporaryDirectory() as path, tempfile.TemporaryDirectory() as outside:
        if _can_make_devices(outside):
            cases.append("device_extra")
        results = run_ranks(2, _load_each, path, outside, cases, timeout=120, pg_timeout_s=30)
    names = {case: results[0]["name:" + case] for case in cases}
    expected = {
        "symlinked_shard": "is a symbolic link",
        "fifo_manifest": "is a FIFO, not a regular file",
        "fifo_extra": "is a FIFO, not a regular file",
        "fifo_latest": "is a FIFO, not a regular file",
        "device_extra": "is a character device, not a regular file",
        "oversized_extra": "bytes, more than the 16 MiB",
    }
    for rank, outcome in enumerate(results):
        for case in cases:
            text = outcome[case]
            assert expected[case] in text and names[case] in text, (rank, case, text)
            assert "found by rank" in text, (rank, case, text)
