"""The workload of `benchmarks.pipeline`: a DLRM-like model whose input all-to-all is a large
share of the step (26 Criteo-sized tables capped at `--rows`, multi-hot bags of narrow rows),
built under DMP with one seed and plan, and its pre-generated batches."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, List, Tuple

import torch
from torch import nn

from benchmarks.ebc_workload import CRITEO_KAGGLE_ROWS
from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.comm.codecs import get_qcomm_codecs_registry
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recshard.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter
from recshard.types import ShardingPlan


@dataclass
class Batch:
    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(
            self.dense_features.pin_memory(),
            self.sparse_features.pin_memory(),
            self.labels.pin_memory(),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.dense_features, self.labels):
            if t.is_cuda:
                t.record_stream(stream)
        self.sparse_features.record_stream(stream)


def _mlp(sizes: List[int]) -> nn.Sequential:
    layers: List[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Model(nn.Module):
    """dense MLP + one EBC (many ids per feature, narrow tables) + over MLP -> (loss, output)."""

    def __init__(self, tables: List[EmbeddingBagConfig], dense_in: int, hidden: int) -> None:
        super().__init__()
        dim = tables[0].embedding_dim
        self.ebc = EmbeddingBagCollection(tables)
        self.dense = _mlp([dense_in, hidden, dim])
        self.over = _mlp([dim * (len(tables) + 1), hidden, hidden, 1])

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        x = torch.cat(
            [self.dense(batch.dense_features), self.ebc(batch.sparse_features).values()], 1
        )
        logits = self.over(x).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def tables(args: argparse.Namespace) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            num_embeddings=min(args.rows, CRITEO_KAGGLE_ROWS[i % 26]),
            embedding_dim=args.dim,
            name=f"t{i}",
            feature_names=[f"f{i}"],
        )
        for i in range(args.features)
    ]


def build(args: argparse.Namespace, world_size: int) -> Tuple[DistributedModelParallel, Any]:
    torch.manual_seed(0)
    model = Model(tables(args), args.dense_in, args.hidden)
    per_table = {f"t{i}": table_wise(i % world_size) for i in range(args.features)}
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(model.ebc, per_table, world_size=world_size)}
    )
    sharders = [
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "exact_sgd", "learning_rate": 0.01},
            qcomm_codecs_registry=get_qcomm_codecs_registry(args.pooled_precision),
        )
    ]
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda p: torch.optim.SGD(p, lr=0.01),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def make_batches(args: argparse.Namespace, rank: int) -> List[Batch]:
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    rows = [t.num_embeddings for t in tables(args)]
    for _ in range(args.pool):
        b = args.batch_size
        lengths = torch.randint(0, 2 * args.pooling + 1, (args.features, b), generator=g)
        values = torch.cat(
            [torch.randint(0, n, (int(ids),), generator=g) for n, ids in zip(rows, lengths.sum(1))]
        )
        lengths = lengths.reshape(-1)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            [f"f{i}" for i in range(args.features)], values, lengths.int()
        )
        out.append(
            Batch(
                torch.randn(b, args.dense_in, generator=g),
                kjt,
                torch.randint(0, 2, (b,), generator=g).float(),
            )
        )
    return out
