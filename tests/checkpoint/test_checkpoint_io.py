"""Checkpoint edge cases on one rank: stateless optimizers, pending gradients, missing files."""

from __future__ import annotations

import tempfile
from typing import Dict

import torch
from dmp_cases import TinyDLRM, batch_for, make_optimizer, train
from multiprocess import run_ranks

from recshard import checkpoint
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder


def _dmp(optim: str) -> DistributedModelParallel:
    torch.manual_seed(0)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": optim, "learning_rate": 0.05}
    )
    return DistributedModelParallel(TinyDLRM(), sharders=[sharder])


def sgd_round_trip(rank: int, ws: int, path: str) -> Dict[str, float]:
    """Plain SGD everywhere (no optimizer state at all) saves and loads."""
    model = _dmp("exact_sgd")
    opt = make_optimizer(model, True, False)
    train(model, opt, range(2), rank, ws)
    checkpoint.save(path, model, opt)
    expected = train(model, opt, range(2, 3), rank, ws)[0]
    fresh = _dmp("exact_sgd")
    fresh_opt = make_optimizer(fresh, True, False)
    checkpoint.load(path, fresh, fresh_opt)
    return {"expected": expected, "resumed": train(fresh, fresh_opt, range(2, 3), rank, ws)[0]}


def pending_grads(rank: int, ws: int, path: str) -> bool:
    """Saving with gradients still in .grad leaves Adagrad's state untouched."""
    model = _dmp("exact_adagrad")
    opt = make_optimizer(model, True, True)
    train(model, opt, range(1), rank, ws)
    dense, kjt, labels = batch_for(1, rank, ws)
    model(dense, kjt, labels).backward()  # gradients pending, no step
    before = {k: v.clone() for k, v in opt.state_dict()["state"].get("over.weight", {}).items()}
    checkpoint.save(path, model, opt)
    after = opt.state_dict()["state"]["over.weight"]
    return bool(before) and all(torch.equal(before[k], after[k]) for k in before)


def test_stateless_optimizers_round_trip() -> None:
    with tempfile.TemporaryDirectory() as path:
        result = run_ranks(1, sgd_round_trip, path, timeout=120)[0]
    assert abs(result["expected"] - result["resumed"]) < 1e-6


def test_save_leaves_optimizer_state_alone() -> None:
    with tempfile.TemporaryDirectory() as path:
        assert run_ranks(1, pending_grads, path, timeout=120)[0]


def read_whole(rank: int, ws: int, path: str) -> bool:
    """`read_checkpoint` assembles every saved tensor whole, equal to the model's."""
    model = _dmp("exact_adagrad")
    opt = make_optimizer(model, True, True)
    train(model, opt, range(2), rank, ws)
    checkpoint.save(path, model, opt)
    state = checkpoint.read_checkpoint(path)
    table = checkpoint.model_state_dict(model.module)["ebc.embedding_bags.ta.weight"]
    whole = torch.empty(table.size())
    for shard in table.local_shards():
        rows, cols = shard.metadata.shard_offsets
        h, w = shard.metadata.shard_sizes
        whole[rows : rows + h, cols : cols + w] = shard.tensor
    return torch.equal(state["model.ebc.embedding_bags.ta.weight"], whole) and torch.equal(
        state["model.over.weight"], model.module.over.weight.detach()
    )


def test_read_checkpoint_assembles_every_tensor() -> None:
    with tempfile.TemporaryDirectory() as path:
        assert run_ranks(1, read_whole, path, timeout=120)[0]
