"""Table configurations: what a table is (rows, dim, features, pooling, dtype, init)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple

import torch

DeviceLike = str | torch.device | None  # where a module's tables live (None: the default)


class PoolingType(enum.Enum):
    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class DataType(enum.Enum):
    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"
    INT4 = "INT4"
    INT2 = "INT2"

    @property
    def element_size(self) -> float:
        """Bytes per element (int4/int2 are fractions of a byte)."""
        return {"FP32": 4, "FP16": 2, "BF16": 2, "INT8": 1, "INT4": 0.5, "INT2": 0.25}[self.value]


DATA_TYPE_TO_DTYPE = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
    DataType.INT8: torch.int8,
}


@dataclass
class BaseEmbeddingConfig:
    """One table. `feature_names` are the KJT keys that look it up (several may share it).

    Weights start uniform in [weight_init_min, weight_init_max], by default
    +-sqrt(1/num_embeddings) as TorchRec; `init_fn(weight)` overrides that.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: List[str] = field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    init_fn: Callable[[torch.Tensor], None] | None = None
    need_pos: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an embedding table needs a name")
        if self.num_embeddings < 1:
            raise ValueError(
                f"table '{self.name}': num_embeddings must be >= 1, got {self.num_embeddings}"
            )
        if self.embedding_dim < 1:
            raise ValueError(
                f"table '{self.name}': embedding_dim must be >= 1, got {self.embedding_dim}"
            )
        if not self.feature_names:
            self.feature_names = [self.name]
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"table '{self.name}': duplicate feature names {self.feature_names}")
        bound = math.sqrt(1.0 / self.num_embeddings)
        if self.weight_init_max is None:
            self.weight_init_max = bound
        if self.weight_init_min is None:
            self.weight_init_min = -bound

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    def init_weight(self, weight: torch.Tensor) -> None:
        """Fill `weight` (the whole table, or a shard of it) with this table's init."""
        with torch.no_grad():
            if self.init_fn is not None:
                self.init_fn(weight)
            else:
                weight.uniform_(self.weight_init_min, self.weight_init_max)


@dataclass
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table (one vector per bag): SUM or MEAN."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooling == PoolingType.NONE:
            raise ValueError(
                f"table '{self.name}': an EmbeddingBagConfig pools; use EmbeddingConfig "
                "for sequence (unpooled) tables"
            )


@dataclass
class EmbeddingConfig(BaseEmbeddingConfig):
    """A sequence table (one vector per id), used by `EmbeddingCollection`."""

    pooling: PoolingType = PoolingType.NONE


class QuantConfig(NamedTuple):
    """`weight().dtype`: how rows are stored (`torch.qint8`, `torch.quint4x2`, ...);
    `activation().dtype`: the output dtype; `per_table_weight_dtype`: overrides by table."""

    activation: Any  # an observer class or partial, e.g. PlaceholderObserver.with_args(...)
    weight: Any
    per_table_weight_dtype: Dict[str, torch.dtype] | None = None
