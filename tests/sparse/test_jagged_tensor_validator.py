"""`validate_keyed_jagged_tensor` (TorchRec's torchrec.sparse.jagged_tensor_validator): the
cases checked side by side with TorchRec 1.8: True when consistent, ValueError when not,
False and a warning naming the feature when ids fall outside their table."""

from __future__ import annotations

import logging
from typing import Callable

import pytest
import torch

from recshard.modules import EmbeddingBagConfig
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse.validation import validate_keyed_jagged_tensor

CONFIGS = [
    EmbeddingBagConfig(num_embeddings=5, embedding_dim=2, name="t", feature_names=["a"]),
    EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="u", feature_names=["b"]),
]


def kjt(values: list, lengths: list) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor(values), torch.tensor(lengths)
    )


def test_consistent_kjt_in_range_is_valid() -> None:
    good = kjt([0, 4, 2, 1], [1, 1, 1, 1])
    assert validate_keyed_jagged_tensor(good) is True
    assert validate_keyed_jagged_tensor(good, CONFIGS) is True
    # a feature no config names is not range-checked
    other = KeyedJaggedTensor.from_lengths_sync(
        ["a", "z"], torch.tensor([1, 99]), torch.tensor([1, 1])
    )
    assert validate_keyed_jagged_tensor(other, CONFIGS) is True


def test_ids_outside_the_table_give_false_and_name_the_feature(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = kjt([0, 5, 2, -1], [1, 1, 1, 1])
    with caplog.at_level(logging.WARNING, logger="recshard.sparse.validation"):
        assert validate_keyed_jagged_tensor(bad, CONFIGS) is False
    text = caplog.text
    assert "feature 'a' has ids in [0, 5], outside its table's [0, 5)" in text
    assert "feature 'b' has ids in [-1, 2], outside its table's [0, 3)" in text
    assert validate_keyed_jagged_tensor(bad) is True  # no configs: no range check


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda: KeyedJaggedTensor(
                ["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 1])
            ),
            "lengths sum to 4 .* but values has 3",
        ),
        (
            lambda: KeyedJaggedTensor(
                ["a", "b"],
                torch.tensor([1, 2, 3, 4]),
                weights=torch.ones(3),
                lengths=torch.tensor([1, 1, 1, 1]),
            ),
            "weights has 3 entries but values has 4",
        ),
        (
            lambda: KeyedJaggedTensor(
                ["a", "b"],
                torch.tensor([1, 2, 3, 4]),
                lengths=torch.tensor([1, 1, 1, 1]),
                offsets=torch.tensor([0, 2, 2, 3, 4]),
            ),
            "offsets are not the running sum",
        ),
        (
            lambda: KeyedJaggedTensor(
                ["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1])
            ),
            "lengths has 3 entries",
        ),
    ],
    ids=["sum", "weights", "offsets", "keys"],
)
def test_inconsistent_kjt_raises(make: Callable[[], KeyedJaggedTensor], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_keyed_jagged_tensor(make(), CONFIGS)
