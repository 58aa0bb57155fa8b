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
        EmbeddingBagConfig(
            num_embeddings=10, embedding_dim=3, name="t1", feature_names=["f1", "f3"]
        ),
        EmbeddingBagConfig(
            num_embeddings=6,
            embedding_dim=1,
            name="t2",
            feature_names=["f2"],
            pooling=PoolingType.MEAN,
        ),
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
        ["f1", "f3"],
        torch.tensor([1, 2, 0, 9]),
        torch.tensor([2, 0, 1, 1]),
        weights=torch.tensor([0.5, 2.0, 1.0, 3.0]),
    )
    out = ebc(features)
    w = ebc.embedding_bags["t1"].weight
    torch.testing.assert_close(out["f1"][0], 0.5 * w[1] + 2.0 * w[2])
    out.values().sum().backward()
    assert w.grad[2].tolist() == [2.0] * 3 and w.grad[9].tolist() == [3.0] * 3


def test_meta_then_reset_parameters_uses_init_bounds() -> None:
    config = EmbeddingBagConfig(
        num_embeddings=100, embedding_dim=4, name="t", weight_init_min=0.5, weight_init_max=0.75
    )
    ebc = EmbeddingBagCollection([config], device="meta")
    assert ebc.embedding_bags["t"].weight.is_meta
    ebc.reset_parameters()
    weight = ebc.embedding_bags["t"].weight
    assert weight.device.type == "cpu" and 0.5 <= weight.min() and weight.max() <= 0.75


def test_ec_returns_one_row_per_id() -> None:
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=10, embedding_dim=2, name="t", feature_names=["a", "b"])]
    )
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
        (
            KeyedJaggedTensor.from_lengths_sync(
                ["f1", "f3"], torch.tensor([1]), torch.tensor([1, 0])
            ),
            r"features \['f2'\] are missing",
        ),
        (
            KeyedJaggedTensor.from_lengths_sync(
                ["f1", "f3", "f2", "zz"], torch.tensor([1]), torch.tensor([1, 0, 0, 0])
            ),
            r"features \['zz'\] that no table reads",
        ),
        (
            KeyedJaggedTensor.from_lengths_sync(
                ["f1", "f3", "f2"], torch.tensor([1, 10, 2]), torch.tensor([1, 1, 1])
            ),
            r"table 't1', feature 'f3': id 10 is outside \[0, 10\)",
        ),
        (
            KeyedJaggedTensor.from_lengths_sync(
                ["f1", "f3", "f2"], torch.tensor([1, 1, -2]), torch.tensor([1, 1, 1])
            ),
            r"table 't2', feature 'f2': id -2 is outside \[0, 6\)",
        ),
        (
            KeyedJaggedTensor.from_lengths_sync(
                ["f1", "f3", "f2"],
                torch.tensor([1.0, 1.0, 2.0]),
                torch.tensor([1, 1, 1]),
                validate=False,
            ),
            "ids must be int32 or int64, got torch.float32",
        ),
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


def _reference_pool(
    config: EmbeddingBagConfig, bag: torch.nn.EmbeddingBag, jt, weighted: bool
) -> torch.Tensor:
    """One feature pooled by torch's own EmbeddingBag (what TorchRec's EBC runs per feature)."""
    sums = bag(
        jt.values(), jt.offsets().long(), per_sample_weights=jt.weights() if weighted else None
    )
    if config.pooling == PoolingType.MEAN:
        sums = sums / jt.lengths().clamp(min=1).unsqueeze(1)
    return sums


MIXED_TABLES = [
    EmbeddingBagConfig(num_embeddings=9, embedding_dim=3, name="a", feature_names=["x", "y", "z"]),
    EmbeddingBagConfig(
        num_embeddings=5,
        embedding_dim=2,
        name="b",
        feature_names=["w", "x"],
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="c", feature_names=["v"]),
]
MIXED_OUTPUTS = {
    "x@a": ("x", "a"),
    "y": ("y", "a"),
    "z": ("z", "a"),
    "w": ("w", "b"),
    "x@b": ("x", "b"),
    "v": ("v", "c"),
}  # output key -> (feature, table)


def _mixed_input(ids_dtype: torch.dtype, weighted: bool) -> KeyedJaggedTensor:
    """Batch 6, keys in another order than the configs', ids < 5 (valid in every table)."""
    keys, g = ["v", "z", "x", "w", "y"], torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (len(keys) * 6,), generator=g)
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=g).to(ids_dtype)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_ebc_one_call_per_table_matches_per_feature_lookups(
    weighted: bool, ids_dtype: torch.dtype
) -> None:
    """Multi-feature tables, a feature two tables read, MEAN, keys out of config order: the
    output equals per-feature torch lookups on the same weights, gradients agree."""
    torch.manual_seed(0)
    features = _mixed_input(ids_dtype, weighted)
    ebc = EmbeddingBagCollection(MIXED_TABLES, is_weighted=weighted)
    out = ebc(features)
    assert out.keys() == list(MIXED_OUTPUTS)
    reference = {
        c.name: torch.nn.EmbeddingBag(
            c.num_embeddings,
            c.embedding_dim,
            mode="sum",
            include_last_offset=True,
            _weight=ebc.embedding_bags[c.name].weight.detach().clone(),
        )
        for c in MIXED_TABLES
    }
    configs = {c.name: c for c in MIXED_TABLES}
    jts = features.to_dict()
    expected = torch.cat(
        [
            _reference_pool(configs[t], reference[t], jts[f], weighted)
            for f, t in MIXED_OUTPUTS.values()
        ],
        dim=1,
    )
    assert torch.equal(out.values(), expected)
    grad = torch.randn_like(expected)
    out.values().backward(grad)
    expected.backward(grad)
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(bag.weight.grad, reference[name].weight.grad)


def test_ec_one_call_per_table_matches_per_feature_lookups() -> None:
    torch.manual_seed(0)
    features = _mixed_input(torch.int64, weighted=False)
    ec = EmbeddingCollection(
        [
            EmbeddingConfig(
                num_embeddings=c.num_embeddings,
                embedding_dim=c.embedding_dim,
                name=c.name,
                feature_names=c.feature_names,
            )
            for c in MIXED_TABLES
        ],
        need_indices=True,
    )
    seq = ec(features)
    assert list(seq) == list(MIXED_OUTPUTS)
    jts = features.to_dict()
    expected_grads = {name: torch.zeros_like(emb.weight) for name, emb in ec.embeddings.items()}
    loss = torch.zeros(())
    for name, (feature, table) in MIXED_OUTPUTS.items():
        jt, source = seq[name], jts[feature]
        assert torch.equal(jt.values(), ec.embeddings[table].weight[source.values()])
        assert torch.equal(jt.lengths(), source.lengths()) and torch.equal(
            jt.weights(), source.values()
        )
        scale = torch.randn_like(jt.values())
        loss = loss + (jt.values() * scale).sum()
        expected_grads[table].index_add_(0, source.values(), scale)
    loss.backward()
    for name, emb in ec.embeddings.items():
        torch.testing.assert_close(emb.weight.grad, expected_grads[name])


def test_ebc_refuses_features_with_different_batch_sizes() -> None:
    features = KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f3", "f2"],
        torch.tensor([1, 2, 3, 4]),
        torch.tensor([1, 1, 1, 0, 1]),
        stride_per_key_per_rank=[[2], [1], [2]],
    )
    with pytest.raises(ValueError, match=r"different batch sizes \{'f1': 2, 'f3': 1, 'f2': 2\}"):
        EmbeddingBagCollection(tables())(features)
