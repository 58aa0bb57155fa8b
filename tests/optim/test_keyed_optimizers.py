"""Keyed optimizers: state keyed by FQN, round trips, and lr schedulers reaching fused kernels."""

from __future__ import annotations

import copy
from typing import Dict

import torch
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # dim 4 runs on fbgemm's TBE, dim 3 on recshard's torch kernel: both must follow lr
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=5, embedding_dim=4, name="t4", feature_names=["a"]
                ),
                EmbeddingBagConfig(
                    num_embeddings=5, embedding_dim=3, name="t3", feature_names=["b"]
                ),
            ]
        )
        self.linear = torch.nn.Linear(7, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.linear(self.ebc(kjt).values()).sum()


def _batch() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 2]), torch.tensor([1, 1])
    )


def scheduled(rank: int, ws: int) -> Dict[str, object]:
    torch.manual_seed(0)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.4}
    )
    model = DistributedModelParallel(_Model(), sharders=[sharder])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda p: torch.optim.SGD(p, lr=0.4),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    moves = []
    for _ in range(3):
        before = {k: v.clone() for k, v in model.state_dict().items() if "ebc" in k}
        optimizer.zero_grad()
        model(_batch()).backward()
        optimizer.step()
        scheduler.step()
        after = model.state_dict()
        moves.append(
            {
                k: (after[k].local_shards()[0].tensor - before[k].local_shards()[0].tensor)
                .abs()
                .sum()
                .item()
                for k in before
            }
        )
    kernels = [k for m in model.module.modules() for k in getattr(m, "kernels", [])]
    lrs = sorted(float(k.tbe.get_learning_rate()) if hasattr(k, "tbe") else k.lr for k in kernels)
    state = optimizer.state_dict()
    restored = copy.deepcopy(state)
    optimizer.load_state_dict(restored)
    return {
        "lrs": lrs,
        "moves": moves,
        "groups": [g["lr"] for g in optimizer.param_groups],
        "keys": sorted(state["state"]),
    }


def test_lr_scheduler_reaches_fused_kernels() -> None:
    result = run_ranks(1, scheduled, timeout=120)[0]
    # updates used 0.4, 0.2, 0.1 (the kernels take the scheduled lr at zero_grad/step); the
    # groups already hold the next one, 0.05
    assert all(abs(lr - 0.1) < 1e-7 for lr in result["lrs"]), result["lrs"]
    assert all(abs(lr - 0.05) < 1e-7 for lr in result["groups"])
    for table in ("ebc.embedding_bags.t4.weight", "ebc.embedding_bags.t3.weight"):
        first, second, third = (step[table] for step in result["moves"])
        # the gradient wrt a table row is the same linear weight each step (up to the dense
        # update), so the halved lr roughly halves the move
        assert second < 0.75 * first and third < 0.75 * second, (table, first, second, third)
    # every fused table is a param of the fused optimizer, stateless (SGD) ones included
    assert {"ebc.embedding_bags.t4.weight", "ebc.embedding_bags.t3.weight"} <= set(result["keys"])
