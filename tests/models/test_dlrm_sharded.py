"""recshard.models.dlrm under DistributedModelParallel on real processes: DLRM and DLRM_DCN
train as the unsharded model does on the same weights and batches (gloo, 2 ranks)."""

from __future__ import annotations

import copy
from typing import List

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.datasets.random import RandomRecDataset
from recshard.datasets.utils import Batch
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from recshard.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter

KEYS = ["f0", "f1", "f2", "f3"]
LR = 0.1
STEPS = 3


def _model(variant: str) -> DLRMTrain:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=8, num_embeddings=50 + 10 * i, feature_names=[key]
        )
        for i, key in enumerate(KEYS)
    ]
    ebc = EmbeddingBagCollection(tables=tables)
    if variant == "dot":
        return DLRMTrain(DLRM(ebc, 5, [16, 8], [12, 1]))
    return DLRMTrain(DLRM_DCN(ebc, 5, [16, 8], [12, 1], dcn_num_layers=2, dcn_low_rank_dim=3))


def _batches(rank: int) -> List[Batch]:
    return list(
        RandomRecDataset(
            KEYS,
            8,
            hash_sizes=[50, 60, 70, 80],
            ids_per_feature=3,
            min_ids_per_feature=0,
            num_dense=5,
            manual_seed=rank,
            num_batches=STEPS,
        )
    )


def _losses(rank: int, world_size: int, variant: str) -> List[float]:
    torch.manual_seed(0)
    reference = _model(variant)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LR}
    )
    dmp = DistributedModelParallel(copy.deepcopy(reference), sharders=[sharder])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=LR),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    losses = []
    for batch in _batches(rank):
        optimizer.zero_grad()
        loss, _ = dmp(batch)
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    # the unsharded model on every rank's batches: the mean loss over ranks, one SGD step each
    every_rank = [_batches(r) for r in range(world_size)]
    plain = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        plain.zero_grad()
        loss = sum(reference(ranks[step])[0] for ranks in every_rank) / world_size
        loss.backward()
        plain.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("variant", ["dot", "dcn"])
def test_sharded_dlrm_trains_like_the_unsharded_one(variant: str) -> None:
    for losses in run_ranks(2, _losses, variant, timeout=240):
        sharded, plain = losses[:STEPS], losses[STEPS:]
        assert plain[0] != plain[-1]  # it trained
        torch.testing.assert_close(torch.tensor(sharded), torch.tensor(plain), atol=1e-5, rtol=1e-5)
