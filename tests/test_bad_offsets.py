"""A KJT whose offsets (given beside lengths) disagree with its lengths: refused naming the key,
on every rank before a collective, instead of numbers that depend on the path. The unsharded
collections read bags by offsets (MEAN divides by lengths), the sharded ones by lengths; offsets
that decrease made the unsharded EmbeddingBagCollection read outside the feature's ids (its
output held uninitialized memory) and recshard's C++ kernel read rows past its table."""

from __future__ import annotations

import copy
import re
from typing import Dict, List

import pytest
import torch
from ebc_cases import make_ebc, plan_for
from multiprocess import run_ranks

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan
from recshard.types import ShardingEnv

VALUES = torch.tensor([1, 2, 3, 4])
ONES = torch.tensor([1, 1, 1, 1])
BAD_OFFSETS = {
    "offsets step past lengths": (
        [0, 2, 2, 3, 4],
        r"offsets are not the running sum of lengths: key 'f0' at batch position 0 has "
        "length 1 but offsets step 2",
    ),
    "offsets decrease": ([0, 4, 2, 3, 4], r"offsets decrease at entry 2 \(key 'f0'\): 4 -> 2"),
}


def _kjt(offsets: List[int], keys: List[str] = ["f0", "f1"]) -> KeyedJaggedTensor:  # noqa: B006
    return KeyedJaggedTensor(keys, VALUES, lengths=ONES, offsets=torch.tensor(offsets))


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_unsharded_bags_refuse_offsets_that_disagree_with_lengths(
    case: str, pooling: PoolingType
) -> None:
    offsets, message = BAD_OFFSETS[case]
    config = EmbeddingBagConfig(
        num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0", "f1"], pooling=pooling
    )
    ebc = EmbeddingBagCollection(tables=[config])
    with pytest.raises(ValueError, match=rf"EmbeddingBagCollection: KeyedJaggedTensor: {message}"):
        ebc(_kjt(offsets))
    consistent = _kjt([0, 1, 2, 3, 4])
    by_lengths = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], VALUES, ONES)
    assert torch.equal(ebc(consistent).values(), ebc(by_lengths).values())


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_unsharded_sequences_refuse_offsets_that_disagree_with_lengths(case: str) -> None:
    offsets, message = BAD_OFFSETS[case]
    config = EmbeddingConfig(
        num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0", "f1"]
    )
    ec = EmbeddingCollection(tables=[config])
    with pytest.raises(ValueError, match=message):
        ec(_kjt(offsets))


def _good() -> KeyedJaggedTensor:
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.tensor([1, 2, 0, 3, 1, 4]), torch.ones(6, dtype=torch.int32)
    )


def _bad(offsets: List[int]) -> KeyedJaggedTensor:
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]
    return KeyedJaggedTensor(
        keys,
        torch.tensor([1, 2, 0, 3, 1, 4]),
        lengths=torch.ones(6, dtype=torch.int32),
        offsets=torch.tensor(offsets),
    )


SHARDED = {
    "offsets step past lengths": ([0, 2, 2, 3, 4, 5, 6], "offsets are not the running sum"),
    "offsets decrease": ([0, 6, 2, 3, 4, 5, 6], r"offsets decrease at entry 2 \(key 'f1'\)"),
}


def _run_sharded(rank: int, ws: int) -> Dict[str, List[str]]:
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    reference = make_ebc(False)
    plan = construct_module_sharding_plan(
        reference, plan_for("mixed", ws, ws, "fused"), world_size=ws
    )
    sharded = EmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
    outcome: Dict[str, List[str]] = {}
    for name, (offsets, _) in SHARDED.items():
        try:
            sharded(_bad(offsets) if rank == 0 else _good()).values().sum().backward()
            outcome[name] = ["no error", ""]
        except (ValueError, RuntimeError) as e:
            outcome[name] = [type(e).__name__, str(e)]
        out = sharded(_good())
        out.values().sum().backward()
        outcome[name].append(f"after: {tuple(out.values().shape)}")
    return outcome


def test_sharded_every_rank_stops_on_offsets_that_disagree_with_lengths() -> None:
    results = run_ranks(2, _run_sharded, timeout=180)
    for name, (_, message) in SHARDED.items():
        kind0, text0, after0 = results[0][name]
        kind1, text1, after1 = results[1][name]
        assert kind0 == "ValueError" and re.search(message, text0), (name, text0)
        assert kind1 == "RuntimeError" and "rank 0 rejected its input" in text1, (name, text1)
        assert after0 == after1 == "after: (1, 26)", (name, after0, after1)
