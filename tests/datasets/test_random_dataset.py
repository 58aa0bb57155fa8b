"""recshard.datasets: RandomRecDataset's arguments and determinism, Batch, the Criteo constants."""

from __future__ import annotations

import pytest
import torch

from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_COLUMN_NAMES,
    DEFAULT_INT_NAMES,
    INT_FEATURE_COUNT,
)
from recshard.datasets.random import RandomRecDataset
from recshard.datasets.utils import Batch
from recshard.modules.feature_processor_ import PositionWeightedModuleCollection
from recshard.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recshard.types import Pipelineable


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def test_shapes_ranges_and_defaults() -> None:
    dataset = RandomRecDataset(
        ["a", "b"],
        batch_size=8,
        hash_sizes=[5, 1000],
        ids_per_features=[3, 1],
        num_dense=4,
        manual_seed=1,
        num_batches=3,
    )
    batches = list(dataset)
    assert len(batches) == len(dataset) == 3
    for batch in batches:
        kjt = batch.sparse_features
        assert kjt.keys() == ["a", "b"] and kjt.stride() == 8
        assert batch.dense_features.shape == (8, 4) and batch.labels.shape == (8,)
        assert set(batch.labels.tolist()) <= {0, 1}
        per_key = kjt.to_dict()
        assert per_key["a"].values().max() < 5 and per_key["b"].values().max() < 1000
        assert 0 <= per_key["a"].lengths().min() and per_key["a"].lengths().max() <= 3
    defaults = next(iter(RandomRecDataset(["x"], 64, manual_seed=0, num_batches=1)))
    assert defaults.dense_features.shape == (64, 50)
    assert (
        defaults.sparse_features.values().max() < 100
        and defaults.sparse_features.lengths().max() <= 2
    )


def test_ids_per_feature_alone_fixes_the_count() -> None:
    """TorchRec: `ids_per_feature` without a minimum gives exactly that many ids per sample."""
    batch = next(
        iter(RandomRecDataset(["a", "b"], 6, ids_per_feature=3, manual_seed=0, num_batches=1))
    )
    assert batch.sparse_features.lengths().tolist() == [3] * 12
    ranged = next(
        iter(
            RandomRecDataset(
                ["a"], 200, ids_per_feature=3, min_ids_per_feature=1, manual_seed=0, num_batches=1
            )
        )
    )
    assert set(ranged.sparse_features.lengths().tolist()) == {1, 2, 3}


def test_seeded_and_cycled() -> None:
    first = list(RandomRecDataset(["a"], 4, manual_seed=7, num_batches=5, num_generated_batches=2))
    again = list(RandomRecDataset(["a"], 4, manual_seed=7, num_batches=5, num_generated_batches=2))
    assert all(_same(x, y) for x, y in zip(first, again))
    assert first[2] is first[0] and first[3] is first[1] and not _same(first[0], first[1])
    fresh = list(RandomRecDataset(["a"], 4, manual_seed=7, num_batches=3, num_generated_batches=-1))
    assert _same(fresh[0], first[0]) and _same(fresh[1], first[1]) and not _same(fresh[2], fresh[0])


def test_endless_without_num_batches() -> None:
    dataset = RandomRecDataset(["a"], 2, manual_seed=0)
    it = iter(dataset)
    assert len([next(it) for _ in range(25)]) == 25
    with pytest.raises(TypeError, match="endless"):
        len(dataset)


def test_bad_arguments_name_the_feature() -> None:
    with pytest.raises(ValueError, match="hash_sizes has 1 values for 2 keys"):
        RandomRecDataset(["a", "b"], 2, hash_sizes=[3])
    with pytest.raises(ValueError, match="feature 'b'"):
        RandomRecDataset(["a", "b"], 2, ids_per_features=[2, 1], min_ids_per_features=[0, 2])


def test_batch_moves_as_a_unit() -> None:
    batch = next(iter(RandomRecDataset(["a"], 3, manual_seed=0, num_batches=1)))
    assert isinstance(batch, Pipelineable)
    moved = batch.to(torch.device("cpu"))
    assert isinstance(moved, Batch) and _same(moved, batch) and moved.batch_size == 3


def test_criteo_constants() -> None:
    assert (INT_FEATURE_COUNT, CAT_FEATURE_COUNT) == (13, 26)
    assert DEFAULT_INT_NAMES[0] == "int_0" and DEFAULT_CAT_NAMES[-1] == "cat_25"
    assert DEFAULT_COLUMN_NAMES == ["label", *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]


def test_position_weighted_features_stay_within_their_max_length() -> None:
    lengths = {"f1": 5}
    ds = RandomRecDataset(
        ["f0", "f1"],
        batch_size=64,
        ids_per_feature=None,
        max_feature_lengths=lengths,
        manual_seed=3,
        num_batches=2,
    )
    tables = [
        EmbeddingBagConfig(num_embeddings=100, embedding_dim=4, name=f"t{i}", feature_names=[f])
        for i, f in enumerate(["f0", "f1"])
    ]
    fp_ebc = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(tables, is_weighted=True), PositionWeightedModuleCollection(lengths)
    )
    for batch in ds:
        bags = batch.sparse_features["f1"].lengths()
        assert int(bags.max()) == 5 and int(bags.min()) >= 0
        assert int(batch.sparse_features["f0"].lengths().max()) <= 2  # the default, unchanged
        fp_ebc(batch.sparse_features)  # every position has a weight
    with pytest.raises(ValueError, match="max_feature_lengths names 'nope'"):
        RandomRecDataset(["f0"], batch_size=2, max_feature_lengths={"nope": 3})


def test_variable_batch_per_feature() -> None:
    """`batch_size_per_feature`: a one-row user feature beside full item features; the KJT's
    inverse indices bring the EBC's output to the batch, each sample reading its own rows."""
    dataset = RandomRecDataset(
        ["user", "item"],
        batch_size=6,
        hash_size=10,
        ids_per_feature=2,
        num_dense=1,
        manual_seed=3,
        num_batches=2,
        batch_size_per_feature={"user": 1},
    )
    batch = next(iter(dataset))
    kjt = batch.sparse_features
    assert kjt.stride_per_key_per_rank() == [[1], [6]]
    assert kjt.lengths().numel() == 7
    keys, rows = kjt.inverse_indices()
    assert keys == ["user", "item"]
    assert rows.tolist() == [[0] * 6, list(range(6))]
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=2, name=f"t_{k}", feature_names=[k])
            for k in keys
        ]
    )
    out = ebc(kjt).values()
    assert out.shape == (6, 4)
    user = ebc.embedding_bags["t_user"].weight[kjt["user"].values()].sum(0)
    assert torch.allclose(out[:, :2], user.expand(6, 2))
    with pytest.raises(ValueError, match="batch_size_per_feature names 'user' with 7"):
        RandomRecDataset(["user"], batch_size=6, batch_size_per_feature={"user": 7})
