"""Bad variable-batch (VBE) input on one rank stops every rank with a clear error: rank 1 gets
each bad batch, rank 0 a good one; rank 1 raises the reason naming the feature and numbers,
rank 0 "rank 1 rejected its input: ..." at once (no collective left waiting), and a good step
then goes through on both. Under a data-parallel-only plan (no splits exchange to carry the
verdict) and a table-wise + row-wise plan. The quantized sharded EBC refuses VBE on every rank."""

from __future__ import annotations

import copy
from typing import List, Tuple

import pytest
import torch
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.quant import QuantEmbeddingBagCollection
from recshard.types import ShardingEnv

KEYS = ["user", "item"]

# (name, KJT arguments' changes on rank 1, the error rank 1 must raise)
BAD = {
    "stride_not_lengths": (
        "the batch sizes per feature {'user': 1, 'item': 3} add up to 4 bags but lengths "
        "has 5 entries"
    ),
    "inverse_out_of_batch": (
        "feature 'user': inverse index 1 at position 2 is outside its batch of 1"
    ),
    "no_inverse": (
        "features have different batch sizes {'user': 1, 'item': 3} and the input has no "
        "inverse_indices"
    ),
    "inverse_missing_feature": "inverse_indices have no rows for features ['item']",
    "rows_per_feature": "stride_per_key_per_rank has 1 rows for the 2 features",
}


def good() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        KEYS,
        torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([2, 1, 0, 2]),
        stride_per_key_per_rank=[[1], [3]],
        inverse_indices=(KEYS, torch.tensor([[0, 0, 0], [0, 1, 2]])),
    )


def bad(kind: str) -> KeyedJaggedTensor:
    values, lengths = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 1, 0, 2])
    spkpr: List[List[int]] = [[1], [3]]
    inverse: Tuple[List[str], torch.Tensor] | None = (KEYS, torch.tensor([[0, 0, 0], [0, 1, 2]]))
    if kind == "stride_not_lengths":
        lengths = torch.tensor([2, 1, 0, 1, 1])
    elif kind == "inverse_out_of_batch":
        inverse = (KEYS, torch.tensor([[0, 0, 1], [0, 1, 2]]))
    elif kind == "no_inverse":
        inverse = None
    elif kind == "inverse_missing_feature":
        inverse = (["user"], torch.tensor([[0, 0, 0]]))
    elif kind == "rows_per_feature":
        spkpr = [[4]]
    return KeyedJaggedTensor(
        KEYS,
        values,
        lengths=lengths,
        stride_per_key_per_rank=spkpr,
        inverse_indices=inverse,
        validate=False,
    )


def module() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name=f"t_{k}", feature_names=[k])
            for k in KEYS
        ]
    )


def run(rank: int, ws: int, plan_kind: str, kind: str) -> Tuple[str, bool]:
    ebc = module()
    per_table = (
        {"t_user": data_parallel(), "t_item": data_parallel()}
        if plan_kind == "data_parallel"
        else {"t_user": row_wise(), "t_item": table_wise(1)}
    )
    plan = construct_module_sharding_plan(ebc, per_table, world_size=ws)
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    sharded = EmbeddingBagCollectionSharder().shard(copy.deepcopy(ebc), plan, env)
    message = ""
    try:
        sharded(bad(kind) if rank == 1 else good()).values().sum().backward()
    except (ValueError, RuntimeError) as e:
        message = str(e)
    out = sharded(good())
    out.values().sum().backward()
    return message, torch.allclose(out.values(), ebc(good()).values(), atol=1e-6)


@pytest.mark.parametrize("plan_kind", ["data_parallel", "table_and_row_wise"])
@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_variable_batch_stops_every_rank(plan_kind: str, kind: str) -> None:
    (message0, good0), (message1, good1) = run_ranks(2, run, plan_kind, kind, timeout=60)
    assert "ShardedEmbeddingBagCollection: " + BAD[kind] in message1, message1
    assert "rank 1 rejected its input" in message0 and BAD[kind][:30] in message0, message0
    assert good0 and good1


def quant_refuses(rank: int, ws: int) -> str:
    qebc = QuantEmbeddingBagCollection.from_float(module(), torch.qint8)
    plan = construct_module_sharding_plan(
        qebc,
        {
            "t_user": table_wise(0, compute_kernel="quant"),
            "t_item": table_wise(1, compute_kernel="quant"),
        },
        sharder=QuantEmbeddingBagCollectionSharder(),
        world_size=ws,
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    sharded = QuantEmbeddingBagCollectionSharder().shard(qebc, plan, env)
    try:
        sharded(good())
    except (ValueError, RuntimeError) as e:
        return str(e)
    return ""


def test_quantized_sharded_ebc_refuses_variable_batch_on_every_rank() -> None:
    for message in run_ranks(2, quant_refuses, timeout=60):
        assert "different batch sizes {'user': 1, 'item': 3}" in message, message
