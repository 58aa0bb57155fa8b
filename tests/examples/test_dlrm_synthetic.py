"""The synthetic Criteo-like generator: determinism, id ranges, skew and a learnable signal."""

from __future__ import annotations

import torch

from examples.dlrm.data import SyntheticConfig, SyntheticCriteo
from examples.dlrm.data.synthetic import zipf_rows
from examples.dlrm.model import build_dlrm
from recshard import EmbeddingBagConfig

SIZES = [50, 3, 1000, 7, 200, 1, 40, 9]


def _batches(rank: int, seed: int, split: str = "train", n: int = 3, multi_hot: int = 1):
    config = SyntheticConfig(SIZES, 16, multi_hot=multi_hot, seed=seed)
    return list(SyntheticCriteo(config, rank=rank, split=split, num_batches=n))


def _same(a, b) -> bool:
    return all(
        torch.equal(x.dense_features, y.dense_features)
        and torch.equal(x.labels, y.labels)
        and torch.equal(x.sparse_features.values(), y.sparse_features.values())
        and torch.equal(x.sparse_features.lengths(), y.sparse_features.lengths())
        for x, y in zip(a, b)
    )


def test_deterministic_per_rank_seed_and_split() -> None:
    assert _same(_batches(0, 1), _batches(0, 1))
    assert not _same(_batches(0, 1), _batches(1, 1))
    assert not _same(_batches(0, 1), _batches(0, 2))
    assert not _same(_batches(0, 1), _batches(0, 1, split="eval"))


def test_ids_in_range_and_multi_hot_lengths() -> None:
    for batch in _batches(0, 0, n=2, multi_hot=4):
        kjt = batch.sparse_features
        assert batch.dense_features.shape == (16, 13) and (batch.dense_features >= 0).all()
        assert set(batch.labels.tolist()) <= {0, 1}
        for f, (key, jt) in enumerate(kjt.to_dict().items()):
            assert key == f"cat_{f}"
            assert jt.lengths().min() >= 1 and jt.lengths().max() <= 4
            assert jt.values().min() >= 0 and jt.values().max() < SIZES[f]


def test_zipf_is_skewed_and_a_bijection_of_ranks() -> None:
    g = torch.Generator().manual_seed(0)
    rows = zipf_rows(1000, 20000, 1.1, offset=123, generator=g)
    counts = torch.bincount(rows, minlength=1000).sort(descending=True).values
    assert counts[:10].sum() > 0.3 * 20000  # the 10 most popular of 1000 ids: > 30% of draws
    everything = zipf_rows(10, 10**5, 0.5, offset=3, generator=g)
    assert set(everything.tolist()) == set(range(10))


def test_signal_is_learnable() -> None:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            num_embeddings=n, embedding_dim=8, name=f"t_cat_{i}", feature_names=[f"cat_{i}"]
        )
        for i, n in enumerate(SIZES)
    ]
    model = build_dlrm(tables, 13, [16, 8], [16, 1])
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    config = SyntheticConfig(SIZES, 256, seed=0)
    losses = []
    for batch in SyntheticCriteo(config, num_batches=30):
        loss, _ = model(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.03


def test_start_batch_continues_the_stream() -> None:
    config = SyntheticConfig(SIZES, 8, seed=5)
    whole = list(SyntheticCriteo(config, rank=1, num_batches=4))
    tail = list(SyntheticCriteo(config, rank=1, num_batches=2, start_batch=2))
    assert _same(whole[2:], tail)
