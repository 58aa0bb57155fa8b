"""Unsharded EmbeddingBagCollection and EmbeddingCollection.

They are the user's model-building blocks (DistributedModelParallel replaces them by sharded
versions) and the numerical reference every sharded path is tested against.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Union

import torch
from torch import nn

from recshard.modules.embedding_configs import (
    DATA_TYPE_TO_DTYPE,
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from recshard.modules.input_checks import check_input
from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

DeviceLike = Union[str, torch.device, None]


def check_unique_tables(tables: Sequence[BaseEmbeddingConfig], owner: str,
                  shared_features: bool = False) -> None:
    """Table names are unique; so are features unless `shared_features` (a feature read by
    several tables, as TorchRec's unsharded collections allow)."""
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{owner}: duplicate table names {dup}")
    features = [f for t in tables for f in t.feature_names]
    if not shared_features and len(set(features)) != len(features):
        dup = sorted({f for f in features if features.count(f) > 1})
        raise ValueError(f"{owner}: features {dup} are read by more than one table")


def _make_weight(config: BaseEmbeddingConfig, device: DeviceLike) -> nn.Parameter:
    dtype = DATA_TYPE_TO_DTYPE.get(config.data_type)
    if dtype is None or not dtype.is_floating_point:
        raise ValueError(
            f"table '{config.name}': data_type {config.data_type.value} is for quantized "
            "inference; train with FP32/FP16/BF16 and use recshard.quant to quantize"
        )
    weight = torch.empty(config.num_embeddings, config.embedding_dim, dtype=dtype, device=device)
    if weight.device.type != "meta":
        config.init_weight(weight)
    return nn.Parameter(weight)


def embedding_names(tables: Sequence[BaseEmbeddingConfig]) -> List[str]:
    """Output keys, one per (table, feature) in config order: the feature's name, or
    `feature@table` for a feature several tables read (TorchRec's names)."""
    features = [f for t in tables for f in t.feature_names]
    shared = {f for f in features if features.count(f) > 1}
    return [f"{f}@{t.name}" if f in shared else f for t in tables for f in t.feature_names]


class _EmbeddingTables(nn.Module):
    """What both collections share: the tables, the feature -> table map and input checks."""

    _tables_attr = ""

    def __init__(self, tables: Sequence[BaseEmbeddingConfig], device: DeviceLike) -> None:
        super().__init__()
        check_unique_tables(tables, type(self).__name__, shared_features=True)
        self._configs = list(tables)
        self._embedding_names = embedding_names(tables)
        self._feature_names = list(dict.fromkeys(f for t in tables for f in t.feature_names))
        # a feature read by several tables must index the smallest of them
        self._feature_to_table: Dict[str, Tuple[str, int]] = {}
        for t in sorted(tables, key=lambda t: -t.num_embeddings):
            for f in t.feature_names:
                self._feature_to_table[f] = (t.name, t.num_embeddings)

    def _weights(self) -> Dict[str, nn.Parameter]:
        return {name: m.weight for name, m in getattr(self, self._tables_attr).items()}

    @property
    def device(self) -> torch.device:
        return next(iter(self._weights().values())).device

    def reset_parameters(self, device: DeviceLike = None) -> None:
        """Initialize every table from its config; tables on `meta` are materialized on
        `device` (default CPU)."""
        for config in self._configs:
            module = getattr(self, self._tables_attr)[config.name]
            if module.weight.device.type == "meta":
                module.weight = _make_weight(config, device or "cpu")
            else:
                config.init_weight(module.weight)

    def _check_input(self, features: KeyedJaggedTensor, is_weighted: bool) -> None:
        check_input(features, self._feature_names, self._feature_to_table, is_weighted,
                    type(self).__name__)


class EmbeddingBagCollection(_EmbeddingTables):
    """Pooled embeddings: one vector per (feature, sample), returned as a `KeyedTensor`
    `[B, sum of dims]` whose keys are the features in config order.

    Several features may share a table. Any `embedding_dim >= 1` works.
    """

    _tables_attr = "embedding_bags"

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: DeviceLike = None,
    ) -> None:
        super().__init__(tables, device)
        self._is_weighted = is_weighted
        self.embedding_bags = nn.ModuleDict()
        for config in tables:
            # MEAN is pooled as SUM and divided here: torch's MEAN bag refuses per-id weights.
            # `_weight` given: torch's default init (slow on meta, and overwritten) is skipped
            self.embedding_bags[config.name] = nn.EmbeddingBag(
                config.num_embeddings, config.embedding_dim, mode="sum",
                include_last_offset=True, _weight=_make_weight(config, device),
            )
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        self._check_input(features, self._is_weighted)
        jts = features.to_dict()
        pooled = []
        for config in self._configs:
            bag = self.embedding_bags[config.name]
            for feature in config.feature_names:
                jt = jts[feature]
                sums = bag(jt.values().long(), jt.offsets().long(), per_sample_weights=jt.weights_or_none())
                if config.pooling == PoolingType.MEAN:
                    sums = sums / jt.lengths().clamp(min=1).unsqueeze(1).to(sums.dtype)
                pooled.append(sums)
        return KeyedTensor(self._embedding_names, self._dims, torch.cat(pooled, dim=1))


class EmbeddingCollection(_EmbeddingTables):
    """Sequence embeddings: one vector per id, returned as `{feature: JaggedTensor}` with
    values `[N_f, D]` and the input's lengths."""

    _tables_attr = "embeddings"

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: DeviceLike = None,
        need_indices: bool = False,
    ) -> None:
        super().__init__(tables, device)
        for config in tables:
            if config.pooling != PoolingType.NONE:
                raise ValueError(
                    f"table '{config.name}': EmbeddingCollection tables are unpooled "
                    f"(pooling NONE), got {config.pooling.value}"
                )
        self._need_indices = need_indices
        self.embeddings = nn.ModuleDict()
        for config in tables:
            self.embeddings[config.name] = nn.Embedding(
                config.num_embeddings, config.embedding_dim, _weight=_make_weight(config, device)
            )

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        self._check_input(features, is_weighted=False)
        jts = features.to_dict()
        out: Dict[str, JaggedTensor] = {}
        names = iter(self._embedding_names)
        for config in self._configs:
            emb = self.embeddings[config.name]
            for feature in config.feature_names:
                jt = jts[feature]
                out[next(names)] = JaggedTensor(
                    emb(jt.values().long()),
                    weights=jt.values() if self._need_indices else None,
                    lengths=jt.lengths(),
                    offsets=jt.offsets(),
                )
        return out
