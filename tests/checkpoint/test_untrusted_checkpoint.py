"""Untrusted checkpoints: a pickle payload planted in any file of a checkpoint never runs.

Two ranks save a trained model with Adagrad state (fused and dense), then, one file at a time,
rank 0 replaces that file with a pickle whose `__reduce__` calls `os.system` (as an attacker
with write access to the checkpoint would). Every rank's `load` must raise an error that names
the file, the payload must not have run, and model and optimizer state must be exactly as
they were. With the file restored the same load succeeds (so the test can fail).
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Dict

import torch.distributed as dist
from ckpt_cases import Payload, state_bytes, trained
from dmp_cases import TinyDLRM
from multiprocess import run_ranks

from recshard import checkpoint


def _plant_in_every_file(rank: int, ws: int, path: str, marker: str) -> Dict[str, str]:
    model, opt = trained(ws, rank, seed=0, steps=2)
    directory = Path(checkpoint.save(path, model, opt, extra={"step": 2}))
    files = sorted([Path(path, "LATEST"), *directory.iterdir()])
    target, target_opt = trained(ws, rank, seed=1, steps=1)
    before = state_bytes(target, target_opt)
    errors: Dict[str, str] = {}
    for file in files:
        original = file.read_bytes()
        if rank == 0:
            file.write_bytes(pickle.dumps(Payload(marker)))
        dist.barrier()
        try:
            checkpoint.load(path, target, target_opt)
            errors[file.name] = "loaded"
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            errors[file.name] = str(e)
        assert state_bytes(target, target_opt) == before, f"{file.name}: state changed"
        dist.barrier()
        if rank == 0:
            file.write_bytes(original)
        dist.barrier()
    # A stale DCP `.metadata` beside the manifest is never read either.
    if rank == 0:
        (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    dist.barrier()
    assert checkpoint.load(path, target, target_opt) == {"step": 2}
    errors["restored"] = "loaded"
    return errors


def test_planted_pickle_in_any_checkpoint_file_never_runs() -> None:
    with tempfile.TemporaryDirectory() as path:
        marker = os.path.join(path, "payload-ran")
        results = run_ranks(2, _plant_in_every_file, path, marker, timeout=240, pg_timeout_s=30)
        assert not os.path.exists(marker)
    for errors in results:
        names = [n for n in errors if n != "restored"]
        assert {"LATEST", "manifest.json", "extra.json"} <= set(names), names
        assert sum(n.endswith(".distcp") for n in names) == 2, names
        for name in names:
            assert name in errors[name], (name, errors[name])
        assert errors["restored"] == "loaded"


def test_latest_may_only_name_a_sibling_directory() -> None:
    """Write access to LATEST alone must not point `load` at another directory."""
    with tempfile.TemporaryDirectory() as path, tempfile.TemporaryDirectory() as elsewhere:
        model = TinyDLRM()
        checkpoint.save(elsewhere, model, extra={"from": "elsewhere"})
        other = checkpoint.latest_checkpoint(elsewhere)
        checkpoint.save(path, model)
        for pointer in [str(other), f"../{Path(elsewhere).name}/{other.name}", "..", "."]:
            Path(path, "LATEST").write_text(pointer)
            try:
                checkpoint.load(path, model)
            except ValueError as e:
                assert f"{path}/LATEST" in str(e), str(e)
                continue
            raise AssertionError(f"LATEST={pointer!r} was followed")
