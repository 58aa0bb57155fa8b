"""Criteo's layout under the example's short names (the constants live in
`recshard.datasets.criteo`), and the capped Kaggle table sizes."""

from __future__ import annotations

from typing import List

from recshard.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    INT_FEATURE_COUNT,
    KAGGLE_NUM_EMBEDDINGS,
)

NUM_DENSE = INT_FEATURE_COUNT
NUM_SPARSE = CAT_FEATURE_COUNT
DENSE_NAMES = DEFAULT_INT_NAMES
SPARSE_NAMES = DEFAULT_CAT_NAMES


def capped_num_embeddings(cap: int) -> List[int]:
    """Kaggle table sizes with every table capped at `cap` rows (ids are hashed into it)."""
    return [min(n, cap) for n in KAGGLE_NUM_EMBEDDINGS]
