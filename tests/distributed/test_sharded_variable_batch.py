"""The sharded EmbeddingBagCollection pools one batch per rank: a variable batch per feature
or inverse_indices (which the unsharded EBC takes, as TorchRec's) are refused on every rank
with an error naming the features, before any collective."""

from __future__ import annotations

import copy
from typing import List, Tuple

import pytest
import torch
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from recshard.types import ShardingEnv


def refused(rank: int, ws: int, kind: str, variable: bool) -> str | None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2"]
            )
        ]
    )
    plan = construct_module_sharding_plan(
        ebc, {"t1": table_wise(rank=0) if kind == "table_wise" else data_parallel()}, world_size=ws
    )
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(ebc), plan, ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    )
    inverse: Tuple[List[str], torch.Tensor] = (["f1", "f2"], torch.tensor([[0, 1], [0, 0]]))
    if variable:
        kjt = KeyedJaggedTensor(
            ["f1", "f2"],
            torch.tensor([1, 2, 3]),
            lengths=torch.tensor([1, 1, 1]),
            stride_per_key_per_rank=[[2], [1]],
            inverse_indices=inverse,
        )
    else:
        kjt = KeyedJaggedTensor(
            ["f1", "f2"],
            torch.tensor([1, 2]),
            lengths=torch.tensor([1, 1]),
            inverse_indices=(["f1", "f2"], torch.tensor([[0], [0]])),
        )
    try:
        sharded(kjt)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["table_wise", "data_parallel"])
@pytest.mark.parametrize("variable", [True, False])
def test_variable_batch_refused_on_every_rank(kind: str, variable: bool) -> None:
    expected = (
        "different batch sizes {'f1': 2, 'f2': 1}"
        if variable
        else "inverse_indices (features ['f1', 'f2'])"
    )
    for message in run_ranks(2, refused, kind, variable, timeout=120):
        assert message is not None and expected in message, message
