"""A training loop that catches a rejected batch and goes on stays in step on every rank.

Rank 1 gets a malformed batch (per-id weights of shape `[N, 1]`, weights of another length,
ids out of range ...) while rank 0's is good; every rank must raise in that same step (the
verdict rides the step's first exchange, `comm/verdict.py`), change nothing, and then train on
as if the bad batch never came: outputs of the later good batches and every table after them
equal a run that never saw the bad batch. Table-wise, data-parallel and row-wise plans of a
weighted EBC with fused SGD, 2 ranks.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from ebc_cases import gather_tables
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.optim import in_backward_optimizer_filter
from recshard.types import ShardingEnv

KEYS = ["f0", "f1"]
ROWS = {"t0": 10, "t1": 6}
GOOD_STEPS = 3


def _good(step: int, rank: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (2, 2), generator=g)
    values = torch.cat(
        [torch.randint(0, ROWS[t], (int(n.sum()),), generator=g) for t, n in zip(ROWS, lengths)]
    )
    weights = torch.rand(values.numel(), generator=g) + 0.5
    return KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths.reshape(-1), weights)


def bad_batches() -> Dict[str, Tuple[KeyedJaggedTensor, str]]:
    """Rank 1's malformed batches and the message it must raise."""
    values, lengths = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 1, 1, 1])

    def kjt(weights: torch.Tensor, ids: torch.Tensor = values) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(KEYS, ids, weights, lengths=lengths, validate=False)

    return {
        "2-D weights": (
            kjt(torch.ones(5, 1)),
            r"weights must be 1-D \(one per id\), got shape \(5, 1\)",
        ),
        "2-D weights of the right count": (
            kjt(torch.ones(1, 5)),
            r"weights must be 1-D \(one per id\), got shape \(1, 5\)",
        ),
        "short weights": (kjt(torch.ones(4)), "weights has 4 entries but values has 5"),
        "id out of range": (
            kjt(torch.ones(5), torch.tensor([1, 2, 3, 4, 6])),
            r"table 't1', feature 'f1': id 6",
        ),
    }


def _plan(kind: str, module: EmbeddingBagCollection, ws: int) -> Dict:
    make = {"table_wise": lambda i: table_wise(i % ws), "row_wise": lambda i: row_wise()}.get(
        kind, lambda i: data_parallel()
    )
    return construct_module_sharding_plan(
        module, {t: make(i) for i, t in enumerate(ROWS)}, world_size=ws
    )


def train(rank: int, ws: int, kind: str, bad: str | None) -> Dict[str, object]:
    """GOOD_STEPS good steps, with `bad` (a case of `bad_batches`) on rank 1 before the second;
    returns each good step's output, the tables at the end and the rejection seen."""
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=4, name=t, feature_names=[f])
        for (t, n), f in zip(ROWS.items(), KEYS)
    ]
    module = EmbeddingBagCollection(configs, is_weighted=True)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.1}
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharded = sharder.shard(module, _plan(kind, module, ws), env)
    dense = [p for _, p in in_backward_optimizer_filter(sharded.named_parameters())]
    optimizer = torch.optim.SGD(dense, lr=0.1) if dense else None

    def step(features: KeyedJaggedTensor) -> torch.Tensor:
        out = sharded(features).values()
        (out * out).sum().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        return out.detach()

    outputs: List[torch.Tensor] = []
    rejection: List[str] = []
    for s in range(GOOD_STEPS):
        if s == 1 and bad is not None:
            batch = bad_batches()[bad][0] if rank == 1 else _good(99, rank)
            try:
                step(batch)
                rejection = ["no error", ""]
            except (ValueError, RuntimeError) as e:
                rejection = [type(e).__name__, str(e)]
        outputs.append(step(_good(s, rank)))
    tables = {name: weight.tolist() for name, weight in gather_tables(sharded, ws).items()}
    # plain lists: tensors would cross the result queue through shared memory
    return {"outputs": [o.tolist() for o in outputs], "tables": tables, "rejection": rejection}


def train_each(rank: int, ws: int, kind: str) -> Dict[str, Dict[str, object]]:
    """`train` without a bad batch ("clean") and with each of `bad_batches`, in one group."""
    runs = {"clean": train(rank, ws, kind, None)}
    for name in bad_batches():
        runs[name] = train(rank, ws, kind, name)
    return runs


@pytest.mark.parametrize("kind", ["table_wise", "data_parallel", "row_wise"])
def test_loop_that_catches_a_bad_batch_stays_in_step(kind: str) -> None:
    per_rank = run_ranks(2, train_each, kind, timeout=150, pg_timeout_s=30)
    for name, (_, message) in bad_batches().items():
        kind1, text1 = per_rank[1][name]["rejection"]
        kind0, text0 = per_rank[0][name]["rejection"]
        assert kind1 == "ValueError" and re.search(message, text1), (name, kind1, text1)
        assert kind0 == "RuntimeError" and "rank 1 rejected its input" in text0, (name, text0)
        for runs in per_rank:
            assert runs[name]["outputs"] == runs["clean"]["outputs"], name
            assert runs[name]["tables"] == runs["clean"]["tables"], name
