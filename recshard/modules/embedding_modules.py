"""Unsharded EmbeddingBagCollection and EmbeddingCollection.

They are the user's model-building blocks (DistributedModelParallel replaces them by sharded
versions) and the numerical reference every sharded path is tested against.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Dict, Hashable, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from recshard.modules.embedding_configs import (
    DATA_TYPE_TO_DTYPE,
    BaseEmbeddingConfig,
    DeviceLike,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from recshard.modules.input_checks import (
    InputKeyOrder,
    check_dtypes_and_weights,
    check_ids,
    check_input,
    check_layout,
    check_rows_per_key,
)
from recshard.modules.lookups import pooled_lookup, sequence_lookup
from recshard.modules.table_groups import (
    GroupStorage,
    KernelLayout,
    fbgemm_kernels_apply,
    grouped_pooled_lookup,
    grouped_sequence_lookup,
    table_weights,
)
from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, jagged_ops
from recshard.sparse.keyed_tensor import offsets_from_sizes

# EC groups stop growing at this many bytes of weights: a group's per-step buffers (rows
# `[N, D]`, the flat gradient) past glibc's mmap threshold are page-faulted anew every step,
# which cost more than the per-table calls saved (criteo_like EC: 2x slower uncapped)
EC_MAX_GROUP_BYTES = 16 << 20


def check_unique_tables(
    tables: Sequence[BaseEmbeddingConfig], owner: str, shared_features: bool = False
) -> None:
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


def _dtype_of(config: BaseEmbeddingConfig) -> torch.dtype:
    dtype = DATA_TYPE_TO_DTYPE.get(config.data_type)
    if dtype is None or not dtype.is_floating_point:
        raise ValueError(
            f"table '{config.name}': data_type {config.data_type.value} is for quantized "
            "inference; train with FP32/FP16/BF16 and use recshard.quant to quantize"
        )
    return dtype


def embedding_names(tables: Sequence[BaseEmbeddingConfig]) -> List[str]:
    """Output keys, one per (table, feature) in config order: the feature's name, or
    `feature@table` for a feature several tables read (TorchRec's names)."""
    features = [f for t in tables for f in t.feature_names]
    shared = {f for f in features if features.count(f) > 1}
    return [f"{f}@{t.name}" if f in shared else f for t in tables for f in t.feature_names]


@dataclass(frozen=True)
class TableSpan:
    """One table's features as a run of keys in the module's lookup order: keys
    `[first, first + count)`; `index` is the table's position in config order."""

    config: BaseEmbeddingConfig
    index: int
    first: int
    count: int


@dataclass(frozen=True)
class TableGroupSpan:
    """Tables read by one kernel call: adjacent in the lookup order (keys `[first, first +
    count)`), same data type, and same pooling (EBC) or dim (EC). `layout` places each key
    in the group's flat storage (for EC, the flat storage as one table `[rows, D]`)."""

    tables: Tuple[TableSpan, ...]
    table_slice: slice  # the group's run of the Parameters in lookup order
    first: int
    count: int
    layout: KernelLayout
    dim: int | None  # the tables' dim when they share one (the group's torch path needs it)
    mean: bool
    feature_dims: torch.Tensor  # [count] each key's dim
    first_row_per_key: torch.Tensor  # [count] each key's table's first row in the flat storage
    rows_per_key: torch.Tensor  # [count] each key's table's rows


class _EmbeddingTables(nn.Module):
    """What both collections share: the tables and their flat storage per group, the
    feature -> table map, the lookup order of keys (group by group, table by table, features
    in config order) and the input checks."""

    _tables_attr = ""

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        group_key: Callable[[BaseEmbeddingConfig], Hashable],
        max_group_bytes: int | None = None,
    ) -> None:
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
        by_key: Dict[Hashable, List[List[int]]] = {}
        group_bytes: Dict[Hashable, int] = {}
        for i, t in enumerate(tables):
            size = t.num_embeddings * t.embedding_dim * _dtype_of(t).itemsize
            key = group_key(t)
            if key not in by_key or (
                max_group_bytes is not None and group_bytes[key] + size > max_group_bytes
            ):
                by_key.setdefault(key, []).append([])
                group_bytes[key] = 0
            by_key[key][-1].append(i)
            group_bytes[key] += size
        self._groups = _group_spans(tables, [g for groups in by_key.values() for g in groups])
        # a feature read by several tables appears once per table
        self._key_order = [
            f for g in self._groups for s in g.tables for f in s.config.feature_names
        ]
        self._storage = GroupStorage([[s.index for s in g.tables] for g in self._groups])
        # each output key (config order): its position in the lookup order
        self._lookup_position = [
            s.first + k
            for s in sorted((s for g in self._groups for s in g.tables), key=lambda s: s.index)
            for k in range(s.count)
        ]
        self._input_order = InputKeyOrder(self._feature_names, self._key_order, type(self).__name__)

    def _new_weights(self, device: DeviceLike) -> List[nn.Parameter]:
        """Every table initialized from its config (not on `meta`), views of one flat tensor
        per group."""
        shapes = [(t.num_embeddings, t.embedding_dim) for t in self._configs]
        fresh = self._storage.allocate(shapes, [_dtype_of(t) for t in self._configs], device)
        for config, weight in zip(self._configs, fresh):
            if weight.device.type != "meta":
                config.init_weight(weight)
        return [nn.Parameter(w) for w in fresh]

    def _tables(self) -> nn.ModuleDict:
        return getattr(self, self._tables_attr)

    @property
    def device(self) -> torch.device:
        return next(iter(self._tables().values())).weight.device

    def reset_parameters(self, device: DeviceLike = None) -> None:
        """Initialize every table from its config; tables on `meta` are materialized on
        `device` (default CPU)."""
        modules = list(self._tables().values())
        if any(m.weight.is_meta for m in modules):
            for module, weight in zip(modules, self._new_weights(device or "cpu")):
                if module.weight.is_meta:
                    module.weight = weight
        for config, module in zip(self._configs, modules):
            config.init_weight(module.weight)
        self._storage.bind(table_weights(self._tables()))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """`to()`, `half()`, ...: the moved tables share one flat storage per group again."""
        result = super()._apply(fn, recurse)
        self._storage.bind(table_weights(self._tables()))
        return result

    def _prepare(self, features: KeyedJaggedTensor, is_weighted: bool) -> KeyedJaggedTensor:
        """The input checked and in `_key_order`. Per call only O(keys) checks and one min
        over lengths (bag offsets the kernels can trust); ids are range-checked by the
        kernels on CPU and here elsewhere; `validate_input` runs every check."""
        owner = type(self).__name__
        permutation = self._input_order.permutation(features)
        check_dtypes_and_weights(features, is_weighted, owner)
        check_layout(features, owner)
        if features.values().device.type != "cpu":
            check_ids(features, self._feature_to_table, owner)
        return features if permutation is None else features.permute(permutation)

    def validate_input(self, features: KeyedJaggedTensor) -> None:
        """Every check of an input (keys, dtypes, layout, ids within their tables, finite
        per-id weights), each a ValueError naming feature, table and value. Forward runs only
        the cheap ones (see `_prepare`)."""
        check_input(
            features,
            self._feature_names,
            self._feature_to_table,
            features.weights_or_none() is not None,
            type(self).__name__,
        )

    def _weights_and_flats(self) -> Tuple[Tuple[nn.Parameter, ...], Sequence[torch.Tensor | None]]:
        """The tables' Parameters in lookup order (`TableGroupSpan.table_slice` picks a
        group's) and each group's flat storage, or None for all under export / compile (they
        trace the per-table path: a traced program cannot read data pointers)."""
        if torch.compiler.is_compiling():
            weights = [module.weight for module in self._tables().values()]
            return self._storage.in_lookup_order(weights), [None] * len(self._groups)
        return self._storage.current(self._tables())

    @contextmanager
    def _explained_id_errors(self, features: KeyedJaggedTensor) -> Iterator[None]:
        """On CPU the lookup kernels bound-check every id themselves; when one refuses the
        batch, the full id check names the table, feature and id instead."""
        try:
            yield
        except (RuntimeError, IndexError):
            check_ids(features, self._feature_to_table, type(self).__name__)
            raise


def _group_spans(
    tables: Sequence[BaseEmbeddingConfig], groups: List[List[int]]
) -> List[TableGroupSpan]:
    spans: List[TableGroupSpan] = []
    first = first_table = 0
    for group in groups:
        configs = [tables[i] for i in group]
        counts = [len(t.feature_names) for t in configs]
        table_spans = tuple(
            TableSpan(t, i, first + at, n)
            for t, i, at, n in zip(configs, group, offsets_from_sizes(counts), counts)
        )
        rows, dims = [t.num_embeddings for t in configs], [t.embedding_dim for t in configs]
        first_rows = offsets_from_sizes(rows)
        per_key = [i for i, n in enumerate(counts) for _ in range(n)]
        sequence = configs[0].pooling == PoolingType.NONE
        layout = (
            KernelLayout.build([sum(rows)], dims[:1], [1])
            if sequence
            else KernelLayout.build(rows, dims, counts)
        )
        spans.append(
            TableGroupSpan(
                tables=table_spans,
                table_slice=slice(first_table, first_table + len(group)),
                first=first,
                count=sum(counts),
                layout=layout,
                dim=dims[0] if len(set(dims)) == 1 else None,
                mean=configs[0].pooling == PoolingType.MEAN,
                feature_dims=torch.tensor([dims[i] for i in per_key]),
                first_row_per_key=torch.tensor([first_rows[i] for i in per_key]),
                rows_per_key=torch.tensor([rows[i] for i in per_key]),
            )
        )
        first += sum(counts)
        first_table += len(group)
    return spans


def one_torch_call_serves(flat: torch.Tensor | None, group: TableGroupSpan) -> bool:
    """Where fbgemm's CPU kernels do not apply, one torch call serves a group whose tables
    share a dim and a flat storage with data (not `meta`, not under export: the flat storage
    is None there); its ids are checked per table first (`flat_rows`; off CPU `_prepare`
    checked them all)."""
    return (
        flat is not None
        and group.dim is not None
        and not flat.is_meta
        and (flat.device.type != "cpu" or jagged_ops.fbgemm_available())
    )


def flat_rows(features: KeyedJaggedTensor, group: TableGroupSpan, check: bool) -> torch.Tensor:
    """`[N]` the group's ids as rows of its flat storage viewed as one table (each id shifted
    by its table's first row), each first checked against its own table when `check`."""
    value_at, length_per_key = features.offset_per_key(), features.length_per_key()
    v0, v1 = value_at[group.first], value_at[group.first + group.count]
    ids = features.values()[v0:v1]
    if len(group.tables) == 1:  # the flat storage is the table: the lookup checks its ids
        return ids
    if check:
        check_rows_per_key(
            ids,
            torch.tensor(value_at[group.first : group.first + group.count + 1]) - v0,
            group.rows_per_key,
        )
    key_lengths = torch.tensor(
        length_per_key[group.first : group.first + group.count], device=ids.device
    )
    return ids + group.first_row_per_key.to(ids.device).repeat_interleave(
        key_lengths, output_size=v1 - v0
    )


def pad_to_one_batch(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A variable-batch KJT as one batch of the largest size: each key's bags followed by
    empty ones (same values; pooled rows past a key's own batch are zeros, never read)."""
    strides = features.stride_per_key()
    batch = max(strides)
    lengths = features.lengths()
    filled = torch.arange(batch, device=lengths.device) < torch.tensor(
        strides, device=lengths.device
    ).unsqueeze(1)  # [F, batch]
    padded = lengths.new_zeros(len(strides), batch).masked_scatter_(filled, lengths)
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        features.weights_or_none(),
        lengths=padded.flatten(),
        stride=batch,
        length_per_key=features.length_per_key(),
        validate=False,
    )


class EmbeddingBagCollection(_EmbeddingTables):
    """Pooled embeddings: one vector per (feature, sample), returned as a `KeyedTensor`
    `[B, sum of dims]` whose keys are the features in config order.

    Several features may share a table. Any `embedding_dim >= 1` works. On CPU (float32) one
    fbgemm kernel call pools every feature of the tables sharing a pooling type and data type
    (`table_groups.py`); elsewhere one `torch.embedding_bag` call per group whose tables
    share a dim (`one_torch_call_serves`), per table on `meta` and under export.
    """

    _tables_attr = "embedding_bags"

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: DeviceLike = None,
    ) -> None:
        super().__init__(tables, group_key=lambda t: (t.pooling, t.data_type))
        self._is_weighted = is_weighted
        self.embedding_bags = nn.ModuleDict()
        for config, weight in zip(tables, self._new_weights(device)):
            # MEAN is pooled as SUM and divided here: torch's MEAN bag refuses per-id weights.
            # `_weight` given: torch's default init (slow on meta, and overwritten) is skipped
            self.embedding_bags[config.name] = nn.EmbeddingBag(
                config.num_embeddings,
                config.embedding_dim,
                mode="sum",
                include_last_offset=True,
                _weight=weight,
            )
        self._storage.bind(table_weights(self.embedding_bags))
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        # output columns in config order, from the lookup order's columns (None: the same)
        column_at = offsets_from_sizes(
            [s.config.embedding_dim for g in self._groups for s in g.tables for _ in range(s.count)]
        )
        columns = [
            column_at[at] + d
            for at, dim in zip(self._lookup_position, self._dims)
            for d in range(dim)
        ]
        self._columns = None if columns == list(range(len(columns))) else torch.tensor(columns)
        self._lookup_dims = torch.tensor(
            [s.config.embedding_dim for g in self._groups for s in g.tables for _ in range(s.count)]
        )

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """`[B, sum of dims]`; with `inverse_indices` (TorchRec's variable batch: each feature
        pooled at its own batch size, then row b of feature f is its pooled row
        `inverse[f, b]`) B is the inverse indices' batch."""
        ordered = self._prepare(features, self._is_weighted)
        inverse = features.inverse_indices_or_none()
        strides = ordered.stride_per_key()
        if len(set(strides)) > 1:
            if inverse is None:
                raise ValueError(
                    f"EmbeddingBagCollection: features have different batch sizes "
                    f"{dict(zip(ordered.keys(), strides))} and the input has no inverse_indices "
                    "to bring them to one batch (TorchRec's variable batch)"
                )
            ordered = pad_to_one_batch(ordered)
        weights, flats = self._weights_and_flats()
        with self._explained_id_errors(features):
            pooled = [
                self._pool(ordered, group, flat, weights[group.table_slice])
                for group, flat in zip(self._groups, flats)
            ]
        values = torch.cat(pooled, dim=1) if len(pooled) > 1 else pooled[0]
        if inverse is not None and inverse[1].numel():
            values = self._expand(values, inverse, strides)
        if self._columns is not None:
            values = values.index_select(1, self._columns.to(values.device))
        return KeyedTensor(self._embedding_names, self._dims, values)

    def _expand(
        self, pooled: torch.Tensor, inverse: Tuple[List[str], torch.Tensor], strides: List[int]
    ) -> torch.Tensor:
        """`[B_out, sum of dims]`: row b of each lookup key's columns is its pooled row
        `inverse[key, b]`, one gather. Inverse keys are feature names, in any order."""
        names, indices = inverse
        row_of = {name: i for i, name in enumerate(names)}
        missing = [f for f in dict.fromkeys(self._key_order) if f not in row_of]
        if missing:
            raise ValueError(
                f"EmbeddingBagCollection: inverse_indices have no rows for features "
                f"{missing} (their keys: {names})"
            )
        rows = indices.index_select(
            0, torch.tensor([row_of[f] for f in self._key_order], device=indices.device)
        )  # [F, B_out]
        bounds = torch.tensor(strides, device=rows.device).unsqueeze(1)
        bad = (rows < 0) | (rows >= bounds)
        if bool(bad.any()):
            key, position = (int(i) for i in torch.nonzero(bad)[0])
            raise ValueError(
                f"EmbeddingBagCollection: feature '{self._key_order[key]}': inverse index "
                f"{int(rows[key, position])} at position {position} is outside its batch of "
                f"{strides[key]}"
            )
        row_index = rows.to(pooled.device).repeat_interleave(
            self._lookup_dims.to(pooled.device), dim=0, output_size=pooled.size(1)
        )
        return pooled.gather(0, row_index.t())

    def _pool(
        self,
        features: KeyedJaggedTensor,
        group: TableGroupSpan,
        flat: torch.Tensor | None,
        weights: Sequence[nn.Parameter],
    ) -> torch.Tensor:
        """`[B, sum of the group's feature dims]`, features side by side in lookup order;
        `weights`: the group's Parameters."""
        entry_at = features.lengths_offset_per_key()
        e0, e1 = entry_at[group.first], entry_at[group.first + group.count]
        if fbgemm_kernels_apply(flat):
            sums = grouped_pooled_lookup(
                group.layout,
                flat,
                weights,
                features.values(),
                features.offsets()[e0 : e1 + 1],
                features.weights_or_none(),
            )
        elif one_torch_call_serves(flat, group):  # one torch call: [count * B, D] -> [B, count * D]
            v0, v1 = (
                features.offset_per_key()[group.first],
                features.offset_per_key()[group.first + group.count],
            )
            per_id_weights = features.weights_or_none()
            sums = pooled_lookup(
                flat.view(-1, group.dim),
                flat_rows(features, group, flat.device.type == "cpu"),
                features.offsets()[e0:e1] - v0,
                None if per_id_weights is None else per_id_weights[v0:v1],
                weights,
            )
            batch = features.stride()
            sums = sums.view(group.count, batch, -1).transpose(0, 1).reshape(batch, -1)
        else:  # one torch call per table
            sums = torch.cat(
                [
                    self._pool_table(features, span, weight)
                    for span, weight in zip(group.tables, weights)
                ],
                dim=1,
            )
        if not group.mean:
            return sums
        counts = features.lengths()[e0:e1].clamp(min=1).view(group.count, -1).t()  # [B, count]
        return sums / counts.repeat_interleave(
            group.feature_dims.to(counts.device), dim=1, output_size=sums.size(1)
        ).to(sums.dtype)

    def _pool_table(
        self, features: KeyedJaggedTensor, span: TableSpan, weight: torch.Tensor
    ) -> torch.Tensor:
        """`[B, count * D]`: one table's features pooled side by side by torch's kernel, one
        call over their ids (on `meta`, under export, and for groups of several dims off
        fbgemm's CPU kernels)."""
        value_at, entry_at = features.offset_per_key(), features.lengths_offset_per_key()
        v0, v1 = value_at[span.first], value_at[span.first + span.count]
        e0, e1 = entry_at[span.first], entry_at[span.first + span.count]
        per_id_weights = features.weights_or_none()
        sums = pooled_lookup(
            weight,
            features.values()[v0:v1],
            features.offsets()[e0:e1] - v0,
            None if per_id_weights is None else per_id_weights[v0:v1],
        )
        if span.count == 1:
            return sums
        batch = features.stride()
        return sums.view(span.count, batch, -1).transpose(0, 1).reshape(batch, -1)


class EmbeddingCollection(_EmbeddingTables):
    """Sequence embeddings: one vector per id, returned as `{feature: JaggedTensor}` with
    values `[N_f, D]` and the input's lengths. On CPU (float32) one lookup (and one fbgemm
    backward call) serves every table sharing a dim and data type, up to
    `EC_MAX_GROUP_BYTES` of weights per group; elsewhere one torch call per group (per table
    on `meta` and under export).
    Each feature's output is a view of its group's rows."""

    _tables_attr = "embeddings"

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: DeviceLike = None,
        need_indices: bool = False,
    ) -> None:
        for config in tables:
            if config.pooling != PoolingType.NONE:
                raise ValueError(
                    f"table '{config.name}': EmbeddingCollection tables are unpooled "
                    f"(pooling NONE), got {config.pooling.value}"
                )
        super().__init__(
            tables,
            group_key=lambda t: (t.embedding_dim, t.data_type),
            max_group_bytes=EC_MAX_GROUP_BYTES,
        )
        self._need_indices = need_indices
        self.embeddings = nn.ModuleDict()
        for config, weight in zip(tables, self._new_weights(device)):
            self.embeddings[config.name] = nn.Embedding(
                config.num_embeddings, config.embedding_dim, _weight=weight
            )
        self._storage.bind(table_weights(self.embeddings))

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        ordered = self._prepare(features, is_weighted=False)
        ids_per_key = ordered.values().split(ordered.length_per_key())
        lengths_per_key = ordered.lengths().split(ordered.stride_per_key())
        weights, flats = self._weights_and_flats()
        with self._explained_id_errors(features):
            per_key = list(
                chain.from_iterable(
                    self._lookup(ordered, group, flat, weights[group.table_slice])
                    for group, flat in zip(self._groups, flats)
                )
            )
        return {
            name: JaggedTensor(
                per_key[k],
                weights=ids_per_key[k] if self._need_indices else None,
                lengths=lengths_per_key[k],
            )
            for name, k in zip(self._embedding_names, self._lookup_position)
        }

    def _lookup(
        self,
        features: KeyedJaggedTensor,
        group: TableGroupSpan,
        flat: torch.Tensor | None,
        weights: Sequence[nn.Parameter],
    ) -> Sequence[torch.Tensor]:
        """`[N_f, D]` per key of the group: one lookup over their ids, split (views);
        `weights`: the group's Parameters."""
        value_at, length_per_key = features.offset_per_key(), features.length_per_key()
        if fbgemm_kernels_apply(flat):
            rows = grouped_sequence_lookup(
                group.layout, flat, weights, flat_rows(features, group, True)
            )
        elif one_torch_call_serves(flat, group):
            rows = sequence_lookup(
                flat.view(-1, group.dim),
                flat_rows(features, group, flat.device.type == "cpu"),
                weights,
            )
        else:  # one torch call per table
            rows = torch.cat(
                [
                    sequence_lookup(
                        weight,
                        features.values()[value_at[span.first] : value_at[span.first + span.count]],
                    )
                    for span, weight in zip(group.tables, weights)
                ]
            )
        return rows.split(length_per_key[group.first : group.first + group.count])
