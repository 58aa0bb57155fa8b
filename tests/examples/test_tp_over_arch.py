"""--tp-over-arch trains exactly like the data-parallel over arch (same init, same batches)."""

from __future__ import annotations

import copy
from typing import List

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from examples.dlrm.data.synthetic import SyntheticConfig, SyntheticCriteo
from examples.dlrm.model import build_dlrm
from examples.dlrm.tp import to_tensor_parallel
from recshard import EmbeddingBagConfig
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recshard.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter
from recshard.types import ShardingPlan

ROWS = [50, 40, 30, 20]


def _model():
    tables = [
        EmbeddingBagConfig(
            num_embeddings=n, embedding_dim=8, name=f"t{i}", feature_names=[f"cat_{i}"]
        )
        for i, n in enumerate(ROWS)
    ]
    torch.manual_seed(0)
    return build_dlrm(tables, 13, [16, 8], [16, 8, 1])


def _train(model, rank: int, tp: bool) -> List[float]:
    ws = dist.get_world_size()
    plan = construct_module_sharding_plan(
        model.model.sparse_arch.embedding_bag_collection,
        {f"t{i}": table_wise(i % ws) for i in range(len(ROWS))},
        world_size=ws,
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.1}
    )
    dmp = DistributedModelParallel(
        model,
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )
    if tp:
        to_tensor_parallel(dmp.module)
    dmp.init_data_parallel()
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda p: torch.optim.SGD(p, lr=0.1),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    config = SyntheticConfig(num_embeddings_per_feature=ROWS, batch_size=8, seed=3)
    losses = []
    for batch in SyntheticCriteo(config, rank=rank, num_batches=4):
        optimizer.zero_grad()
        loss, _ = dmp(batch)
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        if not tp:  # data-parallel: per-rank mean; global mean = average over ranks
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


def compare(rank: int, ws: int) -> List[List[float]]:
    base = _model()
    return [_train(copy.deepcopy(base), rank, tp=False), _train(copy.deepcopy(base), rank, tp=True)]


@pytest.mark.parametrize("world_size", [2])
def test_tp_over_arch_equals_data_parallel(world_size: int) -> None:
    for plain, tp in run_ranks(world_size, compare, timeout=180):
        torch.testing.assert_close(torch.tensor(tp), torch.tensor(plain), atol=1e-5, rtol=1e-5)
