"""Unsharded EBC/EC against sums computed by hand from their weights, and their input errors."""

from __future__ import annotations

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


def tables() -> list:
    return [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="t1", feature_names=["f1", "f3"]),
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=1, name="t2", feature_names=["f2"],
                           pooling=PoolingType.MEAN),
    ]


def kjt(weighted: bool = False) -> KeyedJaggedTensor:
    # f1: [[1, 2], []], f3: [[0], [9]], f2: [[5], [3, 4]]
    return KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f3", "f2"],
        torch.tensor([1, 2, 0, 9, 5, 3, 4]),
        torch.tensor([2, 0, 1, 1, 1, 2]),
        weights=torch.tensor([0.5, 2.0, 1.0, 3.0, 1.0, 1.0, 1.0]) if weighted else None,
    )


def test_ebc_pools_by_hand() -> None:
    ebc = EmbeddingBagCollection(tables())
    out = ebc(kjt())
    assert out.keys() == ["f1", "f3", "f2"] and out.length_per_key() == [3, 3, 1]
    w1, w2 = ebc.embedding_bags["t1"].weight, ebc.embedding_bags["t2"].weight
    torch.testing.assert_close(out["f1"][0], w1[1] + w1[2])
    torch.testing.assert_close(out["f1"][1], torch.zeros(3))
    torch.testing.assert_close(out["f3"][1], w1[9])
    torch.testing.assert_close(out["f2"][1], (w2[3] + w2[4]) / 2)
    assert list(ebc.state_dict()) == ["embedding_bags.t1.weight", "embedding_bags.t2.weight"]


def test_ebc_weighted_and_backward() -> None:
    ebc = EmbeddingBagCollection(tables()[:1], is_weighted=True)
    features = KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f3"], torch.tensor([1, 2, 0, 9]), torch.tensor([2, 0, 1, 1]),
        weights=torch.tensor([0.5, 2.0, 1.0, 3.0]),
    )
    out = ebc(features)
    w = ebc.embedding_bags["t1"].weight
    torch.testing.assert_close(out["f1"][0], 0.5 * w[1] + 2.0 * w[2])
    out.values().sum().backward()
    assert w.grad[2].tolist() == [2.0] * 3 and w.grad[9].tolist() == [3.0] * 3


def test_meta_then_reset_parameters_uses_init_bounds() -> None:
    config = EmbeddingBagConfig(num_embeddings=100, embedding_dim=4, name="t",
                                weight_init_min=0.5, weight_init_max=0.75)
    ebc = EmbeddingBagCollection([config], device="meta")
    assert ebc.embedding_bags["t"].weight.is_meta
    ebc.reset_parameters()
    weight = ebc.embedding_bags["t"].weight
    assert weight.device.type == "cpu" and 0.5 <= weight.min() and weight.max() <= 0.75


def test_ec_returns_one_row_per_id() -> None:
    ec = EmbeddingCollection([EmbeddingConfig(num_embeddings=10, embedding_dim=2, name="t",
                                              feature_names=["a", "b"])])
    features = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 2, 3, 4]), torch.tensor([2, 0, 1, 1])
    )
    out = ec(features)
    w = ec.embeddings["t"].weight
    assert set(out) == {"a", "b"}
    torch.testing.assert_close(out["a"].values(), w[[1, 2]])
    assert out["a"].lengths().tolist() == [2, 0] and out["b"].values().shape == (2, 2)
    assert list(ec.state_dict()) == ["embeddings.t.weight"]


@pytest.mark.parametrize(
    "features, message",
    [
        (KeyedJaggedTensor.from_lengths_sync(["f1", "f3"], torch.tensor([1]), torch.tensor([1, 0])),
         r"features \['f2'\] are missing"),
        (KeyedJaggedTensor.from_lengths_sync(["f1", "f3", "f2", "zz"], torch.tensor([1]),
                                             torch.tensor([1, 0, 0, 0])),
         r"features \['zz'\] that no table reads"),
        (KeyedJaggedTensor.from_lengths_sync(["f1", "f3", "f2"], torch.tensor([1, 10, 2]),
                                             torch.tensor([1, 1, 1])),
         r"table 't1', feature 'f3': id 10 is outside \[0, 10\)"),
        (KeyedJaggedTensor.from_lengths_sync(["f1", "f3", "f2"], torch.tensor([1, 1, -2]),
                                             torch.tensor([1, 1, 1])),
         r"table 't2', feature 'f2': id -2 is outside \[0, 6\)"),
        (KeyedJaggedTensor.from_lengths_sync(["f1", "f3", "f2"], torch.tensor([1.0, 1.0, 2.0]),
                                             torch.tensor([1, 1, 1]), validate=False),
         "ids must be int32 or int64, got torch.float32"),
    ],
)
def test_ebc_bad_input(features: KeyedJaggedTensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EmbeddingBagCollection(tables())(features)


def test_weights_mismatch_and_bad_configs() -> None:
    with pytest.raises(ValueError, match="carries weights but the collection is unweighted"):
        EmbeddingBagCollection(tables())(kjt(weighted=True))
    with pytest.raises(ValueError, match="collection is weighted but the input has no weights"):
        EmbeddingBagCollection(tables(), is_weighted=True)(kjt())
    with pytest.raises(ValueError, match="table 'x': embedding_dim must be >= 1, got 0"):
        EmbeddingBagConfig(num_embeddings=2, embedding_dim=0, name="x")
