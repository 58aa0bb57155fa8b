"""DLRM data: the `Batch` type, a synthetic Criteo-like generator and a Criteo TSV/CSV reader."""

from examples.dlrm.data.batch import make_kjt
from examples.dlrm.data.criteo_spec import (
    DENSE_NAMES,
    KAGGLE_NUM_EMBEDDINGS,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_NAMES,
    capped_num_embeddings,
)
from examples.dlrm.data.synthetic import SyntheticConfig, SyntheticCriteo
from recshard.datasets.utils import Batch

__all__ = [
    "Batch",
    "DENSE_NAMES",
    "KAGGLE_NUM_EMBEDDINGS",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_NAMES",
    "SyntheticConfig",
    "SyntheticCriteo",
    "capped_num_embeddings",
    "make_kjt",
]
