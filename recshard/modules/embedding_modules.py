"""Unsharded EmbeddingBagCollection and EmbeddingCollection.

They are the user's model-building blocks (DistributedModelParallel replaces them by sharded
versions) and the numerical reference every sharded path is tested against.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from recshard.modules.embedding_configs import (
    DATA_TYPE_TO_DTYPE,
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from recshard.modules.input_checks import (
    check_dtypes_and_weights,
    check_features,
    check_ids,
    check_layout,
    check_weights,
)
from recshard.modules.lookups import pooled_lookup, sequence_lookup
from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recshard.sparse.keyed_tensor import offsets_from_sizes

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


@dataclass(frozen=True)
class TableSpan:
    """One table's features as a run of keys in the module's key order: keys
    `[first, first + count)` (ids of a table's features are contiguous there, so one kernel
    call per table reads them all)."""

    config: BaseEmbeddingConfig
    first: int
    count: int


@dataclass(frozen=True)
class _Bags:
    """Per forward: where each key's ids (`value_at`) and bags (`entry_at`) start, each bag's
    start relative to its table's first id (`starts`, `[F * B]`), and for MEAN tables each
    bag's id count, at least 1 (`counts`, `[F * B, 1]`)."""

    value_at: List[int]
    entry_at: List[int]
    starts: torch.Tensor
    counts: Optional[torch.Tensor]


class _EmbeddingTables(nn.Module):
    """What both collections share: the tables, the feature -> table map, the key order the
    lookups read (features in config order, table by table) and the input checks."""

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
        # a feature read by several tables appears once per table
        self._key_order = [f for t in tables for f in t.feature_names]
        firsts = offsets_from_sizes([len(t.feature_names) for t in tables])
        self._spans = [TableSpan(t, first, len(t.feature_names)) for t, first in zip(tables, firsts)]
        # input key order -> permutation into `_key_order` (None: already in it)
        self._permutations: Dict[Tuple[str, ...], Optional[List[int]]] = {}

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

    def _permutation(self, features: KeyedJaggedTensor) -> Optional[List[int]]:
        """Indices that put the input's keys in `_key_order` (None when they are); checked
        and computed once per input key order."""
        keys = tuple(features.keys())
        if keys not in self._permutations:
            check_features(features, self._feature_names, type(self).__name__)
            index = {k: i for i, k in enumerate(keys)}
            permutation = [index[f] for f in self._key_order]
            identity = permutation == list(range(len(keys)))
            self._permutations[keys] = None if identity else permutation
        return self._permutations[keys]

    def _prepare(self, features: KeyedJaggedTensor, is_weighted: bool) -> KeyedJaggedTensor:
        """The input checked (O(1) and O(keys) checks, one reduction over lengths, and on
        devices whose kernels do not check ids, the id check) and in `_key_order`."""
        owner = type(self).__name__
        permutation = self._permutation(features)
        check_dtypes_and_weights(features, is_weighted, owner)
        check_layout(features, owner)
        check_weights(features, self._feature_to_table, owner)
        if features.values().device.type != "cpu":
            check_ids(features, self._feature_to_table, owner)
        return features if permutation is None else features.permute(permutation)

    @contextmanager
    def _explained_id_errors(self, features: KeyedJaggedTensor) -> Iterator[None]:
        """On CPU the lookup kernels bound-check every id themselves; when one refuses the
        batch, the full id check names the table, feature and id instead."""
        try:
            yield
        except (RuntimeError, IndexError):
            check_ids(features, self._feature_to_table, type(self).__name__)
            raise


class EmbeddingBagCollection(_EmbeddingTables):
    """Pooled embeddings: one vector per (feature, sample), returned as a `KeyedTensor`
    `[B, sum of dims]` whose keys are the features in config order.

    Several features may share a table. Any `embedding_dim >= 1` works. One kernel call per
    table pools all of its features (`torch.embedding_bag`, as `nn.EmbeddingBag` runs it).
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
        ordered = self._prepare(features, self._is_weighted)
        if len(set(ordered.stride_per_key())) > 1:
            raise ValueError(
                f"EmbeddingBagCollection: features have different batch sizes "
                f"{dict(zip(ordered.keys(), ordered.stride_per_key()))}; the unsharded "
                "collection pools one batch"
            )
        bags = self._bags(ordered)
        with self._explained_id_errors(features):
            pooled = [self._pool(ordered, bags, span) for span in self._spans]
        return KeyedTensor(self._embedding_names, self._dims, torch.cat(pooled, dim=1))

    def _bags(self, features: KeyedJaggedTensor) -> _Bags:
        """Where each bag starts, relative to its table's first id, for every table at once."""
        value_at, entry_at = features.offset_per_key(), features.lengths_offset_per_key()
        table_entries = torch.tensor(
            [entry_at[s.first + s.count] - entry_at[s.first] for s in self._spans],
            device=features.device())
        table_starts = torch.tensor([value_at[s.first] for s in self._spans], device=features.device())
        starts = features.offsets()[:-1] - table_starts.repeat_interleave(
            table_entries, output_size=entry_at[-1])
        counts = None
        if any(s.config.pooling == PoolingType.MEAN for s in self._spans):
            counts = features.lengths().clamp(min=1).unsqueeze(1)
        return _Bags(value_at, entry_at, starts, counts)

    def _pool(self, features: KeyedJaggedTensor, bags: _Bags, span: TableSpan) -> torch.Tensor:
        """`[B, count * D]`: the table's features pooled side by side, in one kernel call over
        their ids."""
        v0, v1 = bags.value_at[span.first], bags.value_at[span.first + span.count]
        e0, e1 = bags.entry_at[span.first], bags.entry_at[span.first + span.count]
        weights = features.weights_or_none()
        sums = pooled_lookup(
            self.embedding_bags[span.config.name].weight,
            features.values()[v0:v1],
            bags.starts[e0:e1],
            None if weights is None else weights[v0:v1],
        )
        if span.config.pooling == PoolingType.MEAN:
            sums = sums / bags.counts[e0:e1].to(sums.dtype)
        if span.count == 1:
            return sums
        batch = features.stride()
        return sums.view(span.count, batch, -1).transpose(0, 1).reshape(batch, -1)


class EmbeddingCollection(_EmbeddingTables):
    """Sequence embeddings: one vector per id, returned as `{feature: JaggedTensor}` with
    values `[N_f, D]` and the input's lengths. One lookup per table serves all its features;
    each feature's output is a view of it."""

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
        ordered = self._prepare(features, is_weighted=False)
        ids_per_key = ordered.values().split(ordered.length_per_key())
        lengths_per_key = ordered.lengths().split(ordered.stride_per_key())
        with self._explained_id_errors(features):
            rows = [self._lookup(ordered, span) for span in self._spans]
        per_key = [piece for table_rows in rows for piece in table_rows]
        return {
            name: JaggedTensor(values, weights=ids if self._need_indices else None, lengths=lengths)
            for name, values, ids, lengths in zip(
                self._embedding_names, per_key, ids_per_key, lengths_per_key)
        }

    def _lookup(self, features: KeyedJaggedTensor, span: TableSpan) -> Sequence[torch.Tensor]:
        """`[N_f, D]` per feature of the table: one lookup over their ids, split (views)."""
        value_at = features.offset_per_key()
        v0, v1 = value_at[span.first], value_at[span.first + span.count]
        rows = sequence_lookup(self.embeddings[span.config.name].weight, features.values()[v0:v1])
        if span.count == 1:
            return (rows,)
        return rows.split(features.length_per_key()[span.first:span.first + span.count])
