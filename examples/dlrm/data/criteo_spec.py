"""Criteo's layout: 13 integer (dense) and 26 categorical (sparse) features, and table sizes."""

from __future__ import annotations

from typing import List

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"int_{i}" for i in range(NUM_DENSE)]
SPARSE_NAMES = [f"cat_{i}" for i in range(NUM_SPARSE)]

# Distinct values per categorical column in the Criteo Kaggle (Display Advertising) data.
KAGGLE_NUM_EMBEDDINGS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]


def capped_num_embeddings(cap: int) -> List[int]:
    """Kaggle table sizes with every table capped at `cap` rows (ids are hashed into it)."""
    return [min(n, cap) for n in KAGGLE_NUM_EMBEDDINGS]
