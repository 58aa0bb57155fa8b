"""What both unsharded collections share: the tables in kernel groups, their names, and the
checks of an input.

`EmbeddingTables` holds the tables and their flat storage per group (`table_groups.py`), the
feature -> table map and the lookup order of keys (group by group, table by table, features in
config order); `flat_rows` and `one_torch_call_serves` feed one group to one kernel call.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from recshard.modules.embedding_configs import (
    DATA_TYPE_TO_DTYPE,
    BaseEmbeddingConfig,
    DeviceLike,
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
from recshard.modules.table_groups import GroupStorage, KernelLayout, table_weights
from recshard.sparse import KeyedJaggedTensor, jagged_ops
from recshard.sparse.keyed_tensor import offsets_from_sizes


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
    # host metadata (moved to the ids' device where used: the module may move after build)
    feature_dims: torch.Tensor  # [count] each key's dim
    first_row_per_key: torch.Tensor  # [count] each key's table's first row in the flat storage
    rows_per_key: torch.Tensor  # [count] each key's table's rows


class EmbeddingTables(nn.Module):
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
                feature_dims=torch.tensor([dims[i] for i in per_key], device="cpu"),
                first_row_per_key=torch.tensor([first_rows[i] for i in per_key], device="cpu"),
                rows_per_key=torch.tensor([rows[i] for i in per_key], device="cpu"),
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
            torch.tensor(value_at[group.first : group.first + group.count + 1], device=ids.device)
            - v0,
            group.rows_per_key.to(ids.device),
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
