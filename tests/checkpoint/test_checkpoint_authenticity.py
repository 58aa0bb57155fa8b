"""Checkpoints load only data, and with a key only the data its writer signed.

- A tensor of the model declared as a *bytes* entry (DCP would unpickle it) is refused, and the
  pickle planted there never runs.
- No `torch.load` without `weights_only=True`, and no `pickle` loads, anywhere in recshard.
- With a key (argument or RECSHARD_CHECKPOINT_KEY) the manifest carries an HMAC-SHA256; a
  checkpoint without a valid one is refused on every rank, even when the attacker recomputed
  every hash in the manifest.
"""

from __future__ import annotations

import ast
import os
import tempfile
from pathlib import Path
from typing import Dict

import torch
import torch.distributed as dist
from ckpt_cases import Payload, plant, read_manifest, saved_bytes, state_bytes, trained
from ckpt_cases import write_manifest as forge_manifest
from multiprocess import run_ranks

import recshard
from recshard import checkpoint


def _scalar_as_bytes(rank: int, ws: int, path: str, marker: str) -> str:
    model, opt = trained(ws, rank, seed=0, steps=2)
    directory = Path(checkpoint.save(path, model, opt))
    if rank == 0:
        doc = read_manifest(directory)
        key = next(k for k, t in doc["tensors"].items() if k.endswith(".step") and not t["size"])
        del doc["tensors"][key]
        doc["bytes"].append(key)
        next(e for e in doc["storage"] if e["fqn"] == key)["offset"] = None  # as DCP's bytes
        forge_manifest(directory, doc)
        plant(directory, key, saved_bytes(Payload(marker)))
    dist.barrier()
    target, target_opt = trained(ws, rank, seed=1, steps=1)
    before = state_bytes(target, target_opt)
    try:
        checkpoint.load(path, target, target_opt)
        return "loaded"
    except ValueError as e:
        assert state_bytes(target, target_opt) == before, "state changed"
        return str(e)


def test_tensor_declared_as_bytes_is_refused_and_its_pickle_never_runs() -> None:
    with tempfile.TemporaryDirectory() as path:
        marker = os.path.join(path, "payload-ran")
        results = run_ranks(2, _scalar_as_bytes, path, marker, timeout=120, pg_timeout_s=30)
        assert not os.path.exists(marker), "the planted pickle ran"
    for text in results:
        assert "manifest.json" in text and "a bytes entry" in text and ".step" in text, text
        assert "found by rank" in text, text


def _unpickling_calls(tree: ast.AST) -> list:
    """`torch.load(...)` without `weights_only=True`, and any `pickle.load(s)`/Unpickler."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        name = owner.id if isinstance(owner, ast.Name) else ""
        attr = node.func.attr
        if name == "torch" and attr == "load":
            safe = any(
                k.arg == "weights_only"
                and isinstance(k.value, ast.Constant)
                and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                found.append(node.lineno)
        elif name in ("pickle", "cPickle", "dill") and attr in ("load", "loads", "Unpickler"):
            found.append(node.lineno)
    return found


def test_no_code_path_in_recshard_unpickles() -> None:
    package = Path(recshard.__file__).parent
    offenders = []
    for file in sorted(package.rglob("*.py")):
        text = file.read_text()
        lines = _unpickling_calls(ast.parse(text))
        offenders += [f"{file.relative_to(package)}:{n}" for n in lines]
        if "weights_only=False" in text:
            offenders.append(f"{file.relative_to(package)}: weights_only=False")
    assert not offenders, offenders
    # The checker itself finds what it must.
    bad = "import torch, pickle\ntorch.load(f)\ntorch.load(f, weights_only=False)\npickle.loads(b)"
    assert _unpickling_calls(ast.parse(bad)) == [2, 3, 4]


def _signed(rank: int, ws: int, path: str) -> Dict[str, str]:
    signed, unsigned = os.path.join(path, "signed"), os.path.join(path, "unsigned")
    model, opt = trained(ws, rank, seed=0, steps=1)
    directory = Path(checkpoint.save(signed, model, opt, extra={"n": 1}, key=b"k1"))
    checkpoint.save(unsigned, model, opt, extra={"n": 2})
    target, target_opt = trained(ws, rank, seed=1, steps=1)
    before = state_bytes(target, target_opt)
    out: Dict[str, str] = {}

    def attempt(case: str, where: str, **kwargs: object) -> None:
        try:
            out[case] = str(checkpoint.load(where, target, target_opt, **kwargs))
        except ValueError as e:
            assert state_bytes(target, target_opt) == before, f"{case}: state changed"
            out[case] = str(e)

    attempt("wrong_key", signed, key="k2")
    attempt("unsigned", unsigned, key=b"k1")
    os.environ["RECSHARD_CHECKPOINT_KEY"] = "k2"
    attempt("wrong_key_env", signed)
    del os.environ["RECSHARD_CHECKPOINT_KEY"]
    doc = read_manifest(directory)
    dist.barrier()
    if rank == 0:  # new values for table ta, every hash in the manifest recomputed
        plant(directory, "model.ebc.embedding_bags.ta.weight", saved_bytes(torch.ones(10, 4)))
    dist.barrier()
    attempt("forged", signed, key=b"k1")
    dist.barrier()
    if rank == 0:
        doc["hmac"] = "0" * 64
        forge_manifest(directory, doc)
    dist.barrier()
    attempt("bad_hmac", signed, key=b"k1")
    dist.barrier()
    if rank == 0:
        del doc["hmac"]
        forge_manifest(directory, doc)
    dist.barrier()
    attempt("no_hmac", signed, key=b"k1")
    checkpoint.save(signed, model, opt, extra={"n": 3}, key="k1")
    os.environ["RECSHARD_CHECKPOINT_KEY"] = "k1"
    attempt("right_key_env", signed)
    del os.environ["RECSHARD_CHECKPOINT_KEY"]
    attempt("right_key", signed, key=b"k1")
    attempt("signed_without_key", signed)
    out["same"] = str(state_bytes(target, target_opt) == state_bytes(model, opt))
    return out


def test_a_key_refuses_unsigned_forged_or_foreign_checkpoints() -> None:
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(2, _signed, path, timeout=120, pg_timeout_s=30)
    assert results[0] == results[1], results
    out = results[0]
    for case in ("wrong_key", "wrong_key_env", "forged", "bad_hmac"):
        assert "manifest.json: its HMAC does not match" in out[case], (case, out[case])
    for case in ("unsigned", "no_hmac"):
        assert "manifest.json: no HMAC, but a checkpoint key is configured" in out[case], out
    for case in ("right_key_env", "right_key", "signed_without_key"):
        assert out[case] == "{'n': 3}", (case, out[case])
    assert out["same"] == "True"
