"""`RandomRecDataset`: endless (or `num_batches`) random `Batch`es for smoke tests and benchmarks.

Per batch, for each key in order: lengths `[B]` uniform in `[min_ids, max_ids]`, then ids
uniform in `[0, hash_size)`; then dense features `~ N(0, 1)` `[B, num_dense]` and labels in
{0, 1} `[B]`, all drawn from one generator seeded by `manual_seed` — TorchRec's order, so a
seed gives TorchRec's batches. The first `num_generated_batches` batches are made once and
cycled; a negative `num_generated_batches` draws every batch fresh.

Position-weighted features (`max_feature_lengths`, the argument `PositionWeightedModuleCollection`
takes): their bags hold up to that many ids, so every position has a weight.

Variable batch per feature (`batch_size_per_feature`, recshard's; TorchRec's VBE): those
features draw `B_f` bags instead of `batch_size` (e.g. one user row beside the candidate items);
the KJT carries `stride_per_key_per_rank` and `inverse_indices` that map sample b to row
`b * B_f // batch_size` of each feature (a user's samples are consecutive), so an
`EmbeddingBagCollection` returns `[batch_size, ...]` as usual.
"""

from __future__ import annotations

import itertools
from typing import Dict, Iterator, List, Tuple

import torch
from torch.utils.data import IterableDataset

from recshard.datasets.utils import Batch
from recshard.sparse import KeyedJaggedTensor


def _per_key(
    name: str, per_key: List[int] | None, one: int | None, default: int, keys: List[str]
) -> List[int]:
    """`per_key` if given (one value per key), else `one` (or `default`) for every key."""
    if per_key is None:
        per_key = [default if one is None else one] * len(keys)
    if len(per_key) != len(keys):
        raise ValueError(f"RandomRecDataset: {name} has {len(per_key)} values for {len(keys)} keys")
    return list(per_key)


class RandomRecDataset(IterableDataset[Batch]):
    """Random recommendation batches: `keys` sparse features, `num_dense` dense features.

    `hash_size(s)` bound the ids (default 100), `ids_per_feature(s)` the ids per sample
    (default 2), `min_ids_per_feature(s)` their minimum (default: `ids_per_feature` when that
    is given, else 0). The `...s` list forms take precedence over the scalar forms.
    `max_feature_lengths` ({feature: max bag length}, recshard's): those features draw their
    bag lengths in `[min ids, max length]` instead, to feed position-weighted features.
    `batch_size_per_feature` ({feature: batch size in [1, batch_size]}, recshard's): those
    features draw that many bags, a variable batch per feature (see the module docstring).
    """

    def __init__(
        self,
        keys: List[str],
        batch_size: int,
        hash_size: int | None = None,
        hash_sizes: List[int] | None = None,
        ids_per_feature: int | None = None,
        ids_per_features: List[int] | None = None,
        num_dense: int = 50,
        manual_seed: int | None = None,
        num_batches: int | None = None,
        num_generated_batches: int = 10,
        min_ids_per_feature: int | None = None,
        min_ids_per_features: List[int] | None = None,
        max_feature_lengths: Dict[str, int] | None = None,
        batch_size_per_feature: Dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.keys = list(keys)
        self.batch_size = batch_size
        self.hash_sizes = _per_key("hash_sizes", hash_sizes, hash_size, 100, self.keys)
        self.ids_per_features = _per_key(
            "ids_per_features", ids_per_features, ids_per_feature, 2, self.keys
        )
        min_one = ids_per_feature if min_ids_per_feature is None else min_ids_per_feature
        self.min_ids_per_features = _per_key(
            "min_ids_per_features", min_ids_per_features, min_one, 0, self.keys
        )
        for key, length in (max_feature_lengths or {}).items():
            if key not in self.keys or length < 1:
                raise ValueError(
                    f"RandomRecDataset: max_feature_lengths names '{key}' with {length}; it "
                    f"needs one of the keys {self.keys} and a length >= 1"
                )
            self.ids_per_features[self.keys.index(key)] = length
        for key, size, low, high in zip(
            self.keys, self.hash_sizes, self.min_ids_per_features, self.ids_per_features
        ):
            if size < 1 or not 0 <= low <= high:
                raise ValueError(
                    f"RandomRecDataset: feature '{key}' needs hash_size >= 1 and "
                    f"0 <= min ids <= ids, got {size}, {low}, {high}"
                )
        self.batch_sizes = [self.batch_size] * len(self.keys)
        for key, size in (batch_size_per_feature or {}).items():
            if key not in self.keys or not 1 <= size <= batch_size:
                raise ValueError(
                    f"RandomRecDataset: batch_size_per_feature names '{key}' with {size}; it "
                    f"needs one of the keys {self.keys} and a size in [1, {batch_size}]"
                )
            self.batch_sizes[self.keys.index(key)] = size
        self.variable_batch = batch_size_per_feature is not None
        self.num_dense = num_dense
        self.num_batches = num_batches
        self.generator: torch.Generator | None = None
        if manual_seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(manual_seed)
        self.num_generated_batches = num_generated_batches
        self._cached = [self._generate_batch() for _ in range(max(num_generated_batches, 0))]

    def _generate_batch(self) -> Batch:
        values: List[torch.Tensor] = []
        lengths: List[torch.Tensor] = []
        for size, low, high, batch in zip(
            self.hash_sizes, self.min_ids_per_features, self.ids_per_features, self.batch_sizes
        ):
            length = torch.randint(
                low, high + 1, (batch,), dtype=torch.int32, generator=self.generator
            )
            lengths.append(length)
            values.append(torch.randint(0, size, (int(length.sum()),), generator=self.generator))
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys,
            values=torch.cat(values),
            lengths=torch.cat(lengths),
            stride_per_key_per_rank=[[b] for b in self.batch_sizes]
            if self.variable_batch
            else None,
            inverse_indices=self._inverse_indices() if self.variable_batch else None,
        )
        dense = torch.randn(self.batch_size, self.num_dense, generator=self.generator)
        labels = torch.randint(0, 2, (self.batch_size,), generator=self.generator)
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    def _inverse_indices(self) -> Tuple[List[str], torch.Tensor]:
        """`[keys, batch_size]`: sample b reads row `b * B_f // batch_size` of feature f."""
        samples = torch.arange(self.batch_size)
        rows = torch.stack([samples * b // self.batch_size for b in self.batch_sizes])
        return list(self.keys), rows

    def _batches(self) -> Iterator[Batch]:
        if self.num_generated_batches >= 0:
            return itertools.cycle(self._cached) if self._cached else iter(())
        return (self._generate_batch() for _ in itertools.count())

    def __iter__(self) -> Iterator[Batch]:
        return itertools.islice(self._batches(), self.num_batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("RandomRecDataset without num_batches is endless and has no len()")
        return self.num_batches
