"""The local view of a table shard, and the rule that groups shards into one fused kernel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Tuple

from recshard.lookup.fused_params import FusedParams
from recshard.modules.embedding_configs import BaseEmbeddingConfig, PoolingType
from recshard.types import EmbeddingComputeKernel


@dataclass
class LocalTable:
    """One shard of one table held on this rank: `rows x cols` starting at
    (`row_offset`, `col_offset`) of the global table, read by `feature_names`.

    `shard_index` tells column shards of the same table apart.
    `embedding_names`: per feature, the key its ids travel and its output comes back under
    (the feature, or `feature@table` when several tables of the collection read it).
    """

    config: BaseEmbeddingConfig
    rows: int
    cols: int
    row_offset: int
    col_offset: int
    compute_kernel: EmbeddingComputeKernel
    pooling: PoolingType
    fused_params: FusedParams = field(default_factory=FusedParams)
    shard_index: int = 0
    embedding_names: List[str] = field(default_factory=list)  # empty: the feature names

    def __post_init__(self) -> None:
        if not self.embedding_names:
            self.embedding_names = list(self.config.feature_names)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def feature_names(self) -> List[str]:
        return self.config.feature_names

    @property
    def num_features(self) -> int:
        return len(self.config.feature_names)


def group_key(table: LocalTable, uses_fbgemm: bool) -> Tuple[Any, ...]:
    """Tables with equal keys share one kernel: same dtype, pooling, kernel, implementation
    and fused optimizer settings (a kernel applies one optimizer to all its tables)."""
    return (
        table.config.data_type.value,
        table.pooling.value,
        table.compute_kernel.value,
        uses_fbgemm,
        table.fused_params,
    )
