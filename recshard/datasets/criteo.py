"""The Criteo click logs' layout (Kaggle and 1TB): a label, 13 integer and 26 categorical
columns, under TorchRec's constant names; plus the Kaggle tables' distinct-value counts."""

from __future__ import annotations

from typing import List

FREQUENCY_THRESHOLD = 3
INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
DAYS = 24
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: List[str] = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES: List[str] = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]
DEFAULT_COLUMN_NAMES: List[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]
# Rows of days 0-22 of the 1TB logs (day 23 is for validation and test).
TOTAL_TRAINING_SAMPLES = 4195197692

# Distinct values per categorical column in the Criteo Kaggle (Display Advertising) data.
KAGGLE_NUM_EMBEDDINGS: List[int] = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]
