"""A tiny DLRM-like model, global batches split over ranks, and the optimizers DMP tests use."""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recshard.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter
from recshard.types import ShardingPlan

FEATURES = ["a", "b", "c"]
GLOBAL_BATCH = 12
LR = 0.05


def tables() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="ta", feature_names=["a"]),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="tb", feature_names=["b"]),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="tc", feature_names=["c"]),
    ]


class TinyDLRM(nn.Module):
    """dense MLP + EBC + pairwise-dot interaction + over MLP -> BCE loss."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.dense = nn.Linear(3, 4, device=device)
        self.ebc = EmbeddingBagCollection(tables(), device=device)
        self.over = nn.Linear(4 + 6, 1, device=device)

    def forward(
        self, dense: torch.Tensor, sparse: KeyedJaggedTensor, labels: torch.Tensor
    ) -> torch.Tensor:
        d = torch.relu(self.dense(dense))
        embs = [t.values() for t in [self.ebc(sparse)]][0].view(-1, 3, 4)
        stacked = torch.cat([d.unsqueeze(1), embs], dim=1)  # [B, 4, 4]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))
        rows, cols = torch.triu_indices(4, 4, offset=1)
        x = torch.cat([d, dots[:, rows, cols]], dim=1)
        logits = self.over(x).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def global_samples(step: int) -> Tuple[torch.Tensor, List[List[List[int]]], torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    dense = torch.randn(GLOBAL_BATCH, 3, generator=g)
    labels = torch.randint(0, 2, (GLOBAL_BATCH,), generator=g).float()
    rows = [t.num_embeddings for t in tables()]
    ids = [
        [
            torch.randint(
                0, rows[f], (int(torch.randint(0, 3, (1,), generator=g)),), generator=g
            ).tolist()
            for f in range(3)
        ]
        for _ in range(GLOBAL_BATCH)
    ]
    return dense, ids, labels


def batch_for(
    step: int, rank: int, world_size: int
) -> Tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch of `step` (world_size 1: the whole batch)."""
    dense, ids, labels = global_samples(step)
    per = GLOBAL_BATCH // world_size
    mine = range(rank * per, (rank + 1) * per)
    lengths = [len(ids[s][f]) for f in range(3) for s in mine]
    values = [i for f in range(3) for s in mine for i in ids[s][f]]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths)
    )
    return dense[rank * per : (rank + 1) * per], kjt, labels[rank * per : (rank + 1) * per]


def make_optimizer(model: nn.Module, fused: bool, adagrad: bool) -> CombinedOptimizer:
    factory = (
        (lambda p: torch.optim.Adagrad(p, lr=LR))
        if adagrad
        else (lambda p: torch.optim.SGD(p, lr=LR))
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), factory
    )
    parts = [model.fused_optimizer, dense] if fused else [dense]
    return CombinedOptimizer(parts)


def global_loss(local_loss: torch.Tensor, world_size: int) -> float:
    value = local_loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(value)
    return value.item() / world_size


def train(model: nn.Module, optimizer, steps: range, rank: int, world_size: int) -> List[float]:
    losses = []
    for step in steps:
        dense, kjt, labels = batch_for(step, rank, world_size)
        optimizer.zero_grad()
        loss = model(dense, kjt, labels)
        loss.backward()
        optimizer.step()
        losses.append(global_loss(loss, world_size))
    return losses


def table_wise_dmp(ws: int) -> DistributedModelParallel:
    """TinyDLRM under DMP, its tables table-wise over `ws` ranks, exact SGD fused."""
    torch.manual_seed(0)
    per_table = {t: table_wise(i % ws) for i, t in enumerate(["ta", "tb", "tc"])}
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(TinyDLRM("meta").ebc, per_table, world_size=ws)}
    )
    sharders = [
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "exact_sgd", "learning_rate": 0.05}
        )
    ]
    return DistributedModelParallel(TinyDLRM(), plan=plan, sharders=sharders)
