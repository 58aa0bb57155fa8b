"""Synthetic Criteo-like batches with a planted signal, generated on the fly.

Each rank draws its own stream, deterministic in `(seed, rank, split)`. The ids follow a
Zipf law per table (popular ids scattered over the rows by a fixed bijection), dense
features are heavy-tailed counts given as `log(1 + x)` as for real Criteo.

Labels come from a hidden logistic model shared by every rank (it depends on `seed` only):

    logit = bias + dense part (linear in the standardized dense features)
                 + sum over "signal" features of w_f * score_f(id)     (mean over a bag)
                 + one pairwise term score_a * score_b

where `score_f(id)` in [-1, 1] is a hash of (feature, id). Frequent ids are seen often, so
their embeddings learn their score: a DLRM reaches an eval AUC well above 0.5 quickly
(the best possible AUC is about 0.85).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterator, List

import torch

from examples.dlrm.data.criteo_spec import NUM_DENSE, SPARSE_NAMES
from recshard import KeyedJaggedTensor
from recshard.datasets.utils import Batch

_MASK32 = 0xFFFFFFFF
_SPLIT_CODE = {"train": 0, "eval": 1}


@dataclass
class SyntheticConfig:
    """What the generator produces. `multi_hot` > 1 draws 1..multi_hot ids per feature."""

    num_embeddings_per_feature: List[int]
    batch_size: int
    num_dense: int = NUM_DENSE
    multi_hot: int = 1
    zipf_alpha: float = 1.1
    seed: int = 0
    signal_features: int = 10  # how many sparse features carry signal (the first ones)
    positive_rate_bias: float = -1.0  # the hidden model's bias (about 30% positives)

    def __post_init__(self) -> None:
        if self.multi_hot < 1:
            raise ValueError(f"multi_hot must be >= 1, got {self.multi_hot}")
        if self.zipf_alpha <= 0:
            raise ValueError(f"zipf_alpha must be > 0, got {self.zipf_alpha}")
        bad = [n for n in self.num_embeddings_per_feature if n < 1]
        if bad:
            raise ValueError(f"num_embeddings_per_feature must be >= 1, got {bad}")

    @property
    def feature_names(self) -> List[str]:
        n = len(self.num_embeddings_per_feature)
        return SPARSE_NAMES[:n] if n <= len(SPARSE_NAMES) else [f"cat_{i}" for i in range(n)]


def hash_score(feature: torch.Tensor | int, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Deterministic pseudo-random score in [-1, 1] per (feature, id): `[N]` -> `[N]` float."""
    h = (ids * 2654435761 + (feature * 97 + seed * 7919 + 12345)) & _MASK32
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & _MASK32
    h = ((h ^ (h >> 12)) * 0x297A2D39) & _MASK32
    h = h ^ (h >> 15)
    return (h & 0xFFFFFF).to(torch.float32) / float(0xFFFFFF) * 2.0 - 1.0


def zipf_rows(
    num_rows: torch.Tensor | int,
    count: int,
    alpha: float,
    offset: torch.Tensor | int,
    generator: torch.Generator,
    stride: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """`count` ids, Zipf(alpha)-distributed by popularity rank, int64 `[count]`.

    `num_rows`, `offset` (and `stride`) are ints or per-id `[count]` tensors (one table per
    id). Ranks come from the inverse CDF of a continuous power law on [1, num_rows + 1);
    rank r maps to row `(r * stride + offset) mod num_rows`, stride coprime with num_rows,
    so popular rows are spread over the table.
    """
    rows = torch.as_tensor(num_rows, dtype=torch.int64)
    if stride is None:
        stride = _coprime_stride(int(num_rows))
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    n1 = (rows + 1).to(torch.float64)
    if abs(alpha - 1.0) < 1e-6:
        x = n1**u
    else:
        e = 1.0 - alpha
        x = (1.0 + u * (n1**e - 1.0)) ** (1.0 / e)
    ranks = torch.minimum((x.floor().long() - 1).clamp_(min=0), rows - 1)
    return (ranks * stride + offset) % rows


def _coprime_stride(num_rows: int) -> int:
    """A stride near 0.618 * num_rows that is coprime with it (so rank -> row is a bijection)."""
    stride = max(1, int(num_rows * 0.6180339887))
    while math.gcd(stride, num_rows) != 1:
        stride += 1
    return stride


class HiddenModel:
    """The planted logistic model; identical on every rank for a given seed."""

    def __init__(self, config: SyntheticConfig) -> None:
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + 17)
        num_sparse = len(config.num_embeddings_per_feature)
        self.seed = config.seed
        self.dense_mu = torch.rand(config.num_dense, generator=g) * 3.0 + 0.5
        self.dense_sigma = torch.rand(config.num_dense, generator=g) * 1.0 + 0.5
        self.missing_rate = torch.rand(config.num_dense, generator=g) * 0.3
        self.dense_weight = torch.randn(config.num_dense, generator=g) * (
            0.9 / config.num_dense**0.5
        )
        num_signal = min(config.signal_features, num_sparse)
        weight = torch.zeros(num_sparse)
        if num_signal:
            sign = torch.where(torch.rand(num_signal, generator=g) < 0.5, -1.0, 1.0)
            weight[:num_signal] = sign * (0.6 + 0.6 * torch.rand(num_signal, generator=g))
        self.sparse_weight = weight
        self.pair = (0, 1) if num_sparse >= 2 else None
        sizes = config.num_embeddings_per_feature
        self.num_rows = torch.tensor(sizes, dtype=torch.int64)
        self.row_offset = torch.tensor(
            [int(torch.randint(0, n, (1,), generator=g)) for n in sizes], dtype=torch.int64
        )
        self.row_stride = torch.tensor([_coprime_stride(n) for n in sizes], dtype=torch.int64)
        self.bias = config.positive_rate_bias


class SyntheticCriteo:
    """Infinite (or `num_batches`-long) stream of `Batch`es for one rank.

    Batch `i` depends only on `(seed, rank, split, i)`, so a resumed run continues the same
    stream with `start_batch`. `split="eval"` draws other samples from the same hidden model.
    """

    def __init__(
        self,
        config: SyntheticConfig,
        rank: int = 0,
        split: str = "train",
        num_batches: int | None = None,
        start_batch: int = 0,
    ) -> None:
        if split not in _SPLIT_CODE:
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.config = config
        self.rank = rank
        self.split = split
        self.num_batches = num_batches
        self.start_batch = start_batch
        self.hidden = HiddenModel(config)
        self.keys = config.feature_names

    def __iter__(self) -> Iterator[Batch]:
        generator = torch.Generator()
        index = self.start_batch
        while self.num_batches is None or index < self.start_batch + self.num_batches:
            generator.manual_seed(self.batch_seed(index))
            yield self.make_batch(generator)
            index += 1

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an infinite SyntheticCriteo stream has no length")
        return self.num_batches

    def batch_seed(self, index: int) -> int:
        """Seed of batch `index` of this rank's stream."""
        key = (self.config.seed, self.rank, _SPLIT_CODE[self.split], index)
        return zlib.crc32(repr(key).encode()) | (index << 32)

    def make_batch(self, generator: torch.Generator) -> Batch:
        """One batch of `config.batch_size` samples drawn with `generator`."""
        cfg, hidden = self.config, self.hidden
        b = cfg.batch_size
        normal = torch.randn(b, cfg.num_dense, generator=generator)
        log_counts = (hidden.dense_mu + hidden.dense_sigma * normal).clamp(min=0.0)
        missing = torch.rand(b, cfg.num_dense, generator=generator) < hidden.missing_rate
        counts = torch.expm1(log_counts).floor().masked_fill(missing, 0.0)
        dense = torch.log1p(counts)
        standardized = (dense - hidden.dense_mu) / hidden.dense_sigma
        logit = hidden.bias + standardized @ hidden.dense_weight

        # every feature at once, feature-major as the KJT stores them: lengths [F, B]
        num_features = len(cfg.num_embeddings_per_feature)
        if cfg.multi_hot > 1:
            lengths = torch.randint(1, cfg.multi_hot + 1, (num_features, b), generator=generator)
        else:
            lengths = torch.ones(num_features, b, dtype=torch.int64)
        feature_of_id = torch.repeat_interleave(torch.arange(num_features), lengths.sum(1))
        ids = zipf_rows(
            hidden.num_rows[feature_of_id],
            feature_of_id.numel(),
            cfg.zipf_alpha,
            hidden.row_offset[feature_of_id],
            generator,
            stride=hidden.row_stride[feature_of_id],
        )
        bag_of_id = torch.repeat_interleave(torch.arange(num_features * b), lengths.flatten())
        per_id = hash_score(feature_of_id, ids, hidden.seed)
        bag_mean = (
            torch.zeros(num_features * b).index_add_(0, bag_of_id, per_id) / lengths.flatten()
        ).view(num_features, b)
        logit = logit + hidden.sparse_weight @ bag_mean
        if hidden.pair is not None:
            logit = logit + 1.5 * bag_mean[hidden.pair[0]] * bag_mean[hidden.pair[1]]
        labels = (torch.rand(b, generator=generator) < torch.sigmoid(logit)).to(torch.int64)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            self.keys, ids, lengths.flatten().to(torch.int32)
        )
        return Batch(dense, sparse, labels)
