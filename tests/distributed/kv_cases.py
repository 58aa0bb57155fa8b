"""A model with key-value tables for the pipeline and checkpoint tests: a dense linear and an
EBC (t0 dim 4 table-wise, t1 dim 3 row-wise, t2 dim 6 column-wise), Zipf-like ids so rows move
in and out of DRAM caches of a tenth of each shard; built `fused` or `key_value` from the same
seeded weights."""

from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

import torch
from pipeline_cases import Batch
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recshard.types import ShardingPlan

ROWS = [1200, 800, 1000]
STEPS = 8


class Model(nn.Module):
    """dense linear + EBC (t0 dim 4 table-wise, t1 dim 3 row-wise, t2 dim 6 column-wise)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(3, 4)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"]
                )
                for i, (rows, dim) in enumerate(zip(ROWS, [4, 3, 6]))
            ]
        )
        self.over = nn.Linear(4 + 13, 1)

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, None, int]]:
        d = torch.relu(self.dense(batch.dense_features))
        embs = self.ebc(batch.sparse_features).values()
        logits = self.over(torch.cat([d, embs], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), None, batch.index)


def make_batch(step: int, rank: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (len(ROWS), 6), generator=g)
    values = [
        (rows ** torch.rand(int(lengths[i].sum()), generator=g) - 1).long()
        for i, rows in enumerate(ROWS)
    ]
    features = KeyedJaggedTensor.from_lengths_sync(
        [f"f{i}" for i in range(len(ROWS))], torch.cat(values), lengths.reshape(-1)
    )
    labels = torch.randint(0, 2, (6,), generator=g).float()
    return Batch(torch.randn(6, 3, generator=g), features, labels, {}, step)


def build(kernel: str, ws: int, directory: str) -> DistributedModelParallel:
    torch.manual_seed(0)
    model = Model()
    per_table = {
        "t0": table_wise(ws - 1, compute_kernel=kernel),
        "t1": row_wise(compute_kernel=kernel),
        "t2": column_wise(list(range(ws)), compute_kernel=kernel),
    }
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(model.ebc, per_table, world_size=ws)}
    )
    fused: Dict[str, Any] = {"optimizer": "exact_row_wise_adagrad", "learning_rate": 0.05}
    if kernel == "key_value":
        fused.update(ssd_storage_directory=directory, cache_load_factor=0.1)
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused)]
    return DistributedModelParallel(copy.deepcopy(model), plan=plan, sharders=sharders)


def state(model: DistributedModelParallel) -> Dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in model.named_parameters() if "ebc" not in n}
    for table, shards in model.module.ebc.local_table_shards().items():
        for i, (_, weight) in enumerate(shards):
            out[f"{table}.{i}"] = weight.detach().clone()
    return out
