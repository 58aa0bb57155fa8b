"""Checkpoints of key-value tables: save on 2 ranks, load into a fresh key-value model (new
storage files) and into an in-memory fused one; both resume with the losses and weights the
saved model goes on to reach. Load into 1 rank (another world size): key-value and fused agree.
Key-value shards are saved and loaded in pieces of 1 and 4 KiB
(`sharded_state.KEY_VALUE_PIECE_BYTES`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, List

import torch
from dmp_cases import make_optimizer
from kv_cases import build, make_batch, state
from multiprocess import run_ranks
from pipeline_cases import plain_loop

from recshard import checkpoint
from recshard.distributed import sharded_state


def _fresh(kernel: str, ws: int, base: str, rank: int):  # noqa: ANN202
    model = build(kernel, ws, tempfile.mkdtemp(prefix=f"{kernel}-{rank}-", dir=base))
    return model, make_optimizer(model, fused=True, adagrad=False)


def _diff(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> List[str]:
    return [f"{what}: {k} differs" for k in want if not torch.allclose(got[k], want[k], atol=1e-6)]


def save_and_resume(rank: int, ws: int, base: str) -> List[str]:
    sharded_state.KEY_VALUE_PIECE_BYTES = 1024  # key_value shards saved in many pieces
    path = os.path.join(base, "ckpt")
    model, optimizer = _fresh("key_value", ws, base, rank)
    plain_loop(model, optimizer, [make_batch(step, rank) for step in range(3)])
    checkpoint.save(path, model, optimizer)
    later = [make_batch(step, rank) for step in range(3, 5)]
    want_losses = plain_loop(model, optimizer, later)
    want = state(model)
    problems: List[str] = []
    for kernel in ["key_value", "fused"]:
        fresh, fresh_optimizer = _fresh(kernel, ws, base, rank)
        checkpoint.load(path, fresh, fresh_optimizer)
        losses = plain_loop(fresh, fresh_optimizer, later)
        if not torch.allclose(torch.tensor(losses), torch.tensor(want_losses), atol=1e-6):
            problems.append(f"{kernel}: resumed losses {losses} != {want_losses}")
        problems += _diff(state(fresh), want, kernel)
    return problems


def load_elsewhere(rank: int, ws: int, base: str) -> List[str]:
    """Load the 2-rank checkpoint into this world size, key-value and fused, one step each."""
    sharded_state.KEY_VALUE_PIECE_BYTES = 4096  # other pieces than the saved ones
    results = {}
    for kernel in ["key_value", "fused"]:
        model, optimizer = _fresh(kernel, ws, base, rank)
        checkpoint.load(os.path.join(base, "ckpt"), model, optimizer)
        results[kernel] = (plain_loop(model, optimizer, [make_batch(9, rank)]), state(model))
    (kv_losses, kv_state), (losses, fused_state) = results["key_value"], results["fused"]
    problems = _diff(kv_state, fused_state, f"world size {ws}")
    if not torch.allclose(torch.tensor(kv_losses), torch.tensor(losses), atol=1e-6):
        problems.append(f"world size {ws}: losses {kv_losses} != {losses}")
    return problems


def test_key_value_checkpoint_round_trip_and_reshard(tmp_path) -> None:  # noqa: ANN001
    assert run_ranks(2, save_and_resume, str(tmp_path), timeout=300) == [[], []]
    assert run_ranks(1, load_elsewhere, str(tmp_path), timeout=300) == [[]]
