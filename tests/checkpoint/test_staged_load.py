"""A load is all or nothing: content that does not fit the manifest or the model is refused on
every rank, and model and optimizer stay bit-identical.

Two ranks save TinyDLRM (tables table-wise, fused and dense Adagrad state); then, one case at a
time, rank 0 rewrites the checkpoint as an attacker would (the manifest's hashes recomputed, no
key configured), every rank loads into a model trained differently, and each must raise an
error naming the key, the file and the rank that found it, with its state unchanged bit for
bit. The untouched checkpoint then loads (so the comparison can fail).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Dict

import torch
import torch.distributed as dist
from ckpt_cases import (
    Payload,
    last_stored_key,
    plant,
    read_manifest,
    saved_bytes,
    state_bytes,
    trained,
)
from ckpt_cases import write_manifest as forge_manifest
from multiprocess import run_ranks

from recshard import checkpoint

TABLE = "model.ebc.embedding_bags.ta.weight"  # [10, 4], table-wise on rank 0


def _forge(directory: Path, case: str) -> None:
    if case == "pickle_as_tensor":  # torch.save of an object whose unpickling runs a command
        plant(directory, TABLE, saved_bytes(Payload(str(directory.parent / "payload-ran"))))
    elif case == "wider":
        plant(directory, TABLE, saved_bytes(torch.randn(20, 4)))
    elif case == "int64_data":
        plant(directory, TABLE, saved_bytes(torch.arange(40).view(10, 4)))
    elif case == "int64_in_manifest":
        plant(directory, TABLE, saved_bytes(torch.arange(40).view(10, 4)))
        doc = read_manifest(directory)
        doc["tensors"][TABLE]["dtype"] = "int64"
        forge_manifest(directory, doc)
    elif case in ("nan", "nan_allowed"):
        values = torch.randn(10, 4)
        values[3, 1] = float("nan")
        plant(directory, TABLE, saved_bytes(values))
    elif case == "bad_last_key":
        plant(directory, last_stored_key(directory), saved_bytes(torch.zeros(3, 3)))


CASES = {  # case -> what the error must say
    "pickle_as_tensor": "not a saved tensor (UnpicklingError: Weights only load failed",
    "wider": "has shape (20, 4) in the file, the manifest says (10, 4)",
    "int64_data": "holds torch.int64 values, the manifest says torch.float32",
    "int64_in_manifest": "has dtype torch.int64 in manifest.json but torch.float32 in the model",
    "nan": "1 of 40 values are NaN or infinite (pass allow_non_finite=True",
    "bad_last_key": "has shape (3, 3) in the file, the manifest says",
}


def _load_each_forgery(rank: int, ws: int, path: str) -> Dict[str, str]:
    model, opt = trained(ws, rank, seed=0, steps=2)
    directory = Path(checkpoint.save(path, model, opt, extra={"step": 2}))
    backup = Path(path) / "backup"
    target, target_opt = trained(ws, rank, seed=1, steps=1)
    before = state_bytes(target, target_opt)
    if rank == 0:
        shutil.copytree(directory, backup)
    outcome: Dict[str, str] = {}
    for case in [*CASES, "nan_allowed"]:
        if rank == 0:
            _forge(directory, case)
        dist.barrier()
        try:
            checkpoint.load(path, target, target_opt, allow_non_finite=case == "nan_allowed")
            outcome[case] = "loaded"
        except ValueError as e:
            outcome[case] = str(e)
        if case != "nan_allowed":
            assert state_bytes(target, target_opt) == before, f"{case}: state changed"
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
            shutil.copytree(backup, directory)
        dist.barrier()
    outcome["last_key"] = last_stored_key(directory)
    assert not (Path(path) / "payload-ran").exists(), "the planted pickle ran"
    assert checkpoint.load(path, target, target_opt) == {"step": 2}
    outcome["restored"] = str(state_bytes(target, target_opt) == state_bytes(model, opt))
    return outcome


def test_forged_content_is_refused_on_every_rank_and_nothing_changes() -> None:
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(2, _load_each_forgery, path, timeout=240, pg_timeout_s=30)
    assert results[0] == results[1], results  # the same verdict on every rank
    outcome = results[0]
    for case, expected in CASES.items():
        text = outcome[case]
        assert expected in text, (case, text)
        file = "manifest.json" if case == "int64_in_manifest" else "forged.distcp"
        assert file in text and "found by rank" in text, (case, text)
        key = outcome["last_key"] if case == "bad_last_key" else "ebc.embedding_bags.ta.weight"
        assert key.split(".", 1)[1] in text, (case, text)
    assert outcome["nan_allowed"] == "loaded"
    assert outcome["restored"] == "True"
