"""A KJT whose offsets (given beside lengths) disagree with its lengths: refused naming the key,
on every rank before a collective, instead of numbers that depend on the path. The unsharded
collections read bags by offsets (MEAN divides by lengths), the sharded ones by lengths; offsets
that decrease made the unsharded EmbeddingBagCollection read outside the feature's ids (its
output held uninitialized memory) and recshard's C++ kernel read rows past its table. The
sharded collection's cases (every rank stops) are in tests/test_bad_inputs.py."""

from __future__ import annotations

from typing import List

import pytest
import torch

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)

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
