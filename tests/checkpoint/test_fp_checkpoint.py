"""A sharded FeatureProcessedEmbeddingBagCollection's checkpoint saved at 2 ranks loads at 1 and
3 ranks (another plan per world size): tables and position weights come back as saved, and the
state dict names the position weights as the unsharded module does."""

from __future__ import annotations

import tempfile
from typing import Dict, List

import torch
import torch.distributed as dist
from ebc_cases import LR, batch, gather_tables
from fp_cases import make_fp_ebc, sharded_model
from multiprocess import run_ranks

from recshard import checkpoint
from recshard.optim import in_backward_optimizer_filter

POSITION_KEY = "fp._feature_processors.position_weights.f1"


def _full_state(model, ws: int) -> Dict[str, List]:
    """Every table assembled from all ranks, and this rank's position weights (as lists: the
    harness returns plain data)."""
    sharded = model.module.fp
    state = {
        f"table.{k}": v for k, v in gather_tables(sharded._embedding_bag_collection, ws).items()
    }
    for name, p in sharded._feature_processors.named_parameters(prefix="fp._feature_processors"):
        state[name] = p.detach().clone()
    return {k: v.tolist() for k, v in state.items()}


def save_after_a_step(rank: int, ws: int, path: str) -> Dict[str, List]:
    model = sharded_model(make_fp_ebc("collection"), "mixed", "fused", ws)
    opt = torch.optim.SGD(
        [p for _, p in in_backward_optimizer_filter(model.named_parameters())], lr=LR
    )
    model(batch(rank, 0, 3, False, False)).values().sum().backward()
    opt.step()
    keys = model.state_dict().keys()
    assert POSITION_KEY in keys and "fp._embedding_bag_collection.embedding_bags.t0.weight" in keys
    checkpoint.save(path, model)
    dist.barrier()
    return _full_state(model, ws)


def load_fresh(rank: int, ws: int, path: str) -> Dict[str, List]:
    model = sharded_model(make_fp_ebc("collection", seed=1), "mixed", "fused", ws)
    checkpoint.load(path, model)
    return _full_state(model, ws)


def test_checkpoint_saved_at_two_ranks_loads_at_one_and_three() -> None:
    with tempfile.TemporaryDirectory() as path:
        saved = run_ranks(2, save_after_a_step, path, timeout=300)
        assert saved[0][POSITION_KEY] == saved[1][POSITION_KEY]
        initial = make_fp_ebc("collection").position_weights()["f1"].tolist()
        assert saved[0][POSITION_KEY] != initial  # the step moved them
        for ws in (1, 3):
            loaded = run_ranks(ws, load_fresh, path, timeout=300)
            for rank, state in enumerate(loaded):
                for key, value in saved[0].items():
                    assert state[key] == value, f"world size {ws} rank {rank}: {key}"
