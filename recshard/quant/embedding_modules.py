"""Quantized EmbeddingBagCollection / EmbeddingCollection for inference, and the converter.

    model = quantize_embeddings(trained_model, torch.quint4x2)   # EBCs and ECs -> INT4 rows
    model(dense, kjt)                                             # same inputs, same outputs

Each table's `data_type` (INT8, INT4, INT2, FP16, FP32) says how its rows are stored (see
`recshard.quant.rowwise` for the layout and its error). Inputs are checked as the float
modules check them: per call the O(keys) checks and those that keep fbgemm's kernel inside
its memory (bag offsets, ids within their tables: one fbgemm bounds check), every check
(non-finite per-id weights too) in `validate_input`; outputs are float32 (or `output_dtype`). State
dict per table: `<attr>.<table>.weight` (packed codes, `uint8 [rows, D * bits / 8]`, or fp16/fp32
`[rows, D]`) and, for integer types, `.weight_qscale` / `.weight_qbias` (`fp16 [rows]`), all views
of the kernel's storage, so `load_state_dict` writes straight into it; it also takes TorchRec's
layout (`weight` = fbgemm's whole rows, scale and bias inside, padded to 16 bytes).
"""

from __future__ import annotations

import copy
import dataclasses
from itertools import chain
from typing import Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn

from recshard.modules.embedding_configs import BaseEmbeddingConfig, DeviceLike, PoolingType
from recshard.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recshard.modules.embedding_tables import check_unique_tables
from recshard.modules.input_checks import (
    InputKeyOrder,
    check_dtypes_and_weights,
    check_ids_per_key,
    check_input,
    check_layout,
    check_one_batch,
)
from recshard.quant.config import dtypes_from_qconfig
from recshard.quant.kernel import QuantLookup, QuantTable, check_output_dtype
from recshard.quant.rowwise import (
    DtypeLike,
    check_table_layout,
    data_type_of,
    quantize_rows,
    split_fused_rows,
)
from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

QuantizedWeights = Dict[str, Tuple[torch.Tensor, torch.Tensor | None]]


def _quant_table(config: BaseEmbeddingConfig) -> QuantTable:
    return QuantTable(
        config.name,
        config.num_embeddings,
        config.embedding_dim,
        config.data_type,
        list(config.feature_names),
        getattr(config, "pooling", PoolingType.NONE),
    )


class _QuantTables(nn.Module):
    """What both quantized collections share: tables, kernels, input checks, weight views."""

    _tables_attr = ""

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        groups: List[List[int]],
        pooled: bool,
        is_weighted: bool,
        device: DeviceLike,
        output_dtype: torch.dtype,
        table_name_to_quantized_weights: QuantizedWeights | None,
    ) -> None:
        super().__init__()
        check_unique_tables(tables, type(self).__name__)
        check_output_dtype(output_dtype)
        for config in tables:
            check_table_layout(config.name, config.embedding_dim, config.data_type)
        self._configs = list(tables)
        self._output_dtype = output_dtype
        self._feature_names = [f for t in tables for f in t.feature_names]
        self._feature_to_table = {
            f: (t.name, t.num_embeddings) for t in tables for f in t.feature_names
        }
        device = torch.device(device or "cpu")
        self.lookups = nn.ModuleList(
            QuantLookup(
                [_quant_table(self._configs[i]) for i in group], pooled, device, output_dtype
            )
            for group in groups
        )
        # table name -> (kernel index, table index inside it)
        self._where = {
            self._configs[i].name: (k, j)
            for k, group in enumerate(groups)
            for j, i in enumerate(group)
        }
        self._register_weight_views()
        self._register_load_state_dict_pre_hook(self._accept_fused_rows)
        self._is_weighted = is_weighted
        # the kernels' key order: group after group, features in config order
        self._key_order = [f for lookup in self.lookups for f in lookup.feature_names]
        self._input_order = InputKeyOrder(self._feature_names, self._key_order, type(self).__name__)
        self._rows_per_key = torch.tensor(  # host metadata, moved to the ids' device per call
            [self._feature_to_table[f][1] for f in self._key_order], device="cpu"
        )
        quantized = table_name_to_quantized_weights
        for config in self._configs:
            k, j = self._where[config.name]
            if quantized is not None and config.name in quantized:
                self.lookups[k].load_quantized(j, *quantized[config.name])
            else:  # a fresh module starts from each config's init, quantized
                weight = torch.empty(config.num_embeddings, config.embedding_dim, device=device)
                config.init_weight(weight)
                self.lookups[k].load_float(j, weight)

    def _accept_fused_rows(self, state_dict: Dict[str, torch.Tensor], prefix: str, *_) -> None:
        """Load-state-dict pre-hook: a table's `weight` in TorchRec's layout (fbgemm's whole
        rows, scale and bias inside, no `weight_qscale` / `weight_qbias` keys) is split into
        this module's three views."""
        for config in self._configs:
            key = f"{prefix}{self._tables_attr}.{config.name}.weight"
            rows = state_dict.get(key)
            if rows is None or f"{key}_qscale" in state_dict:
                continue
            fused = split_fused_rows(rows, config.embedding_dim, config.data_type)
            if fused is not None:
                codes, scale_bias = fused
                state_dict[key] = codes
                state_dict[f"{key}_qscale"] = scale_bias[:, 0]
                state_dict[f"{key}_qbias"] = scale_bias[:, 1]

    def _register_weight_views(self) -> None:
        tables = nn.ModuleDict()
        for config in self._configs:
            k, j = self._where[config.name]
            values, scale_bias = self.lookups[k].storage()[j]
            holder = nn.Module()
            holder.register_buffer("weight", values)
            if scale_bias is not None:
                holder.register_buffer("weight_qscale", scale_bias[:, 0])
                holder.register_buffer("weight_qbias", scale_bias[:, 1])
            tables[config.name] = holder
        setattr(self, self._tables_attr, tables)

    @property
    def device(self) -> torch.device:
        return self.lookups[0].tbe.current_device

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    def quantized_weights(self) -> QuantizedWeights:
        """`{table: (values, scale_bias)}` as the kernel stores them (views)."""
        out = {}
        for config in self._configs:
            k, j = self._where[config.name]
            out[config.name] = self.lookups[k].storage()[j]
        return out

    def storage_bytes(self) -> int:
        """Bytes the kernels hold for all tables (rows, scale/bias and alignment padding)."""
        return sum(lookup.storage_bytes() for lookup in self.lookups)

    def validate_input(self, features: KeyedJaggedTensor) -> None:
        """Every check of an input (keys, dtypes, layout, ids within their tables, finite
        per-id weights), each a ValueError naming feature, table and value. Forward runs only
        the cheap ones and those that keep the kernel inside its memory (see `_prepare`)."""
        check_input(
            features,
            self._feature_names,
            self._feature_to_table,
            self._is_weighted,
            type(self).__name__,
        )

    def _prepare(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The input checked and in the kernels' key order: keys once per key order, dtypes,
        bag offsets within `values` (`check_layout`) and every id within its table (one fbgemm
        bounds check; fbgemm's inference kernel checks neither). Non-finite per-id weights
        are left to `validate_input`."""
        owner = type(self).__name__
        permutation = self._input_order.permutation(features)
        check_dtypes_and_weights(features, self._is_weighted, owner)
        check_layout(features, owner)
        ordered = features if permutation is None else features.permute(permutation)
        check_ids_per_key(ordered, self._rows_per_key, self._feature_to_table, owner)
        return ordered


class QuantEmbeddingBagCollection(_QuantTables):
    """`EmbeddingBagCollection` with quantized rows: `KeyedTensor [B, sum of dims]`, features
    in config order. One fbgemm kernel holds every table (mixed dtypes and dims)."""

    _tables_attr = "embedding_bags"

    def __init__(
        self,
        tables: List[BaseEmbeddingConfig],
        is_weighted: bool = False,
        device: DeviceLike = None,
        output_dtype: torch.dtype = torch.float32,
        table_name_to_quantized_weights: QuantizedWeights | None = None,
    ) -> None:
        super().__init__(
            tables,
            [list(range(len(tables)))],
            True,
            is_weighted,
            device,
            output_dtype,
            table_name_to_quantized_weights,
        )
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]

    @classmethod
    def from_float(
        cls,
        module: EmbeddingBagCollection,
        dtype: DtypeLike | Mapping[str, DtypeLike] | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> QuantEmbeddingBagCollection:
        """Quantize a trained EBC (on its device). `dtype`: one for all tables or per table;
        None: from `module.qconfig` (a `QuantConfig`, as `quantize_dynamic` sets it)."""
        dtype, output_dtype = _dtypes(module, dtype, output_dtype)
        configs = _quantized_configs(module.embedding_bag_configs(), dtype)
        weights = _quantize_tables(module.embedding_bags, configs)
        return cls(configs, module.is_weighted(), module.device, output_dtype, weights)

    def embedding_bag_configs(self) -> List[BaseEmbeddingConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled `[B, sum of dims]`. A variable batch per feature is refused, naming the
        batch sizes: the inference kernel pools one batch (TorchRec's hands it the variable
        batch's offsets as one batch and returns too few rows)."""
        check_one_batch(features, type(self).__name__)
        pooled = self.lookups[0](self._prepare(features))
        return KeyedTensor(self._feature_names, self._dims, pooled)


class QuantEmbeddingCollection(_QuantTables):
    """`EmbeddingCollection` with quantized rows: `{feature: JaggedTensor}` with values
    `[N_f, D]`. fbgemm's sequence kernel takes one dim, so tables are grouped by dim."""

    _tables_attr = "embeddings"

    def __init__(
        self,
        tables: List[BaseEmbeddingConfig],
        device: DeviceLike = None,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float32,
        table_name_to_quantized_weights: QuantizedWeights | None = None,
    ) -> None:
        by_dim: Dict[int, List[int]] = {}
        for i, config in enumerate(tables):
            by_dim.setdefault(config.embedding_dim, []).append(i)
        super().__init__(
            tables,
            list(by_dim.values()),
            False,
            False,
            device,
            output_dtype,
            table_name_to_quantized_weights,
        )
        self._need_indices = need_indices
        self._features_per_lookup = [len(lookup.feature_names) for lookup in self.lookups]
        # each output key (config order): its position in the kernels' key order
        position = {f: i for i, f in enumerate(self._key_order)}
        self._output_positions = [position[f] for f in self._feature_names]

    @classmethod
    def from_float(
        cls,
        module: EmbeddingCollection,
        dtype: DtypeLike | Mapping[str, DtypeLike] | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> QuantEmbeddingCollection:
        """As QuantEmbeddingBagCollection.from_float."""
        dtype, output_dtype = _dtypes(module, dtype, output_dtype)
        configs = _quantized_configs(module.embedding_configs(), dtype)
        weights = _quantize_tables(module.embeddings, configs)
        return cls(configs, module.device, module.need_indices(), output_dtype, weights)

    def embedding_configs(self) -> List[BaseEmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """One lookup per dim group, split into each feature's rows (views)."""
        ordered = self._prepare(features)
        ids_per_key = ordered.values().split(ordered.length_per_key())
        lengths_per_key = ordered.lengths().split(ordered.stride_per_key())
        parts = ordered.split(self._features_per_lookup) if len(self.lookups) > 1 else [ordered]
        rows = list(
            chain.from_iterable(
                lookup(part).split(part.length_per_key())
                for lookup, part in zip(self.lookups, parts)
            )
        )
        return {
            name: JaggedTensor(
                rows[k],
                weights=ids_per_key[k] if self._need_indices else None,
                lengths=lengths_per_key[k],
            )
            for name, k in zip(self._feature_names, self._output_positions)
        }


# ------------------------------------------------------------------------------ conversion


def _dtypes(
    module: nn.Module,
    dtype: DtypeLike | Mapping[str, DtypeLike] | None,
    output_dtype: torch.dtype | None,
) -> Tuple[DtypeLike | Mapping[str, DtypeLike], torch.dtype]:
    """What from_float was asked for, else what `module.qconfig` says, else INT8 -> float32."""
    qconfig = getattr(module, "qconfig", None)
    if qconfig is None:
        return (
            torch.qint8 if dtype is None else dtype,
            torch.float32 if output_dtype is None else output_dtype,
        )
    weight, per_table, activation = dtypes_from_qconfig(qconfig)
    if dtype is None:
        dtype = {c.name: per_table.get(c.name, weight) for c in _configs_of(module)}
    return dtype, activation if output_dtype is None else output_dtype


def _configs_of(module: nn.Module) -> Sequence[BaseEmbeddingConfig]:
    if isinstance(module, EmbeddingBagCollection):
        return module.embedding_bag_configs()
    return module.embedding_configs()


def _quantized_configs(
    configs: Sequence[BaseEmbeddingConfig], dtype: DtypeLike | Mapping[str, DtypeLike]
) -> List[BaseEmbeddingConfig]:
    """Copies of `configs` with the storage type of `dtype`; checks every table first."""
    out = []
    for config in configs:
        wanted = dtype.get(config.name, torch.qint8) if isinstance(dtype, Mapping) else dtype
        data_type = data_type_of(wanted, config.name)
        check_table_layout(config.name, config.embedding_dim, data_type)
        out.append(dataclasses.replace(config, data_type=data_type))
    return out


def _quantize_tables(tables: nn.ModuleDict, configs: List[BaseEmbeddingConfig]) -> QuantizedWeights:
    return {c.name: quantize_rows(tables[c.name].weight, c.data_type, c.name) for c in configs}


def quantize_embeddings(
    model: nn.Module,
    dtype: DtypeLike = torch.qint8,
    inplace: bool = True,
    output_dtype: torch.dtype = torch.float32,
    per_table_weight_dtype: Mapping[str, DtypeLike] | None = None,
) -> nn.Module:
    """Replace every `EmbeddingBagCollection` / `EmbeddingCollection` in `model` by its
    quantized twin; returns the model (the new module if `model` itself is one).

    `dtype`: `torch.qint8` (INT8), `torch.quint4x2` (INT4), `torch.quint2x4` (INT2),
    `torch.float16` or `torch.float32`; `per_table_weight_dtype` overrides it per table name.
    Every table is checked before anything changes, so a bad dtype or dim (INT4 needs an even
    dim, INT2 a multiple of 4) raises a ValueError naming the table and leaves `model` intact.
    """
    if not inplace:
        model = copy.deepcopy(model)
    per_table = dict(per_table_weight_dtype or {})

    def dtypes_for(configs: Sequence[BaseEmbeddingConfig]) -> Dict[str, DtypeLike]:
        return {c.name: per_table.get(c.name, dtype) for c in configs}

    def convert(module: nn.Module) -> nn.Module:
        if type(module) is EmbeddingBagCollection:
            return QuantEmbeddingBagCollection.from_float(
                module, dtypes_for(module.embedding_bag_configs()), output_dtype
            )
        return QuantEmbeddingCollection.from_float(
            module, dtypes_for(module.embedding_configs()), output_dtype
        )

    collections = [
        m for m in model.modules() if type(m) in (EmbeddingBagCollection, EmbeddingCollection)
    ]
    for module in collections:  # validate everything before converting anything
        configs = (
            module.embedding_bag_configs()
            if isinstance(module, EmbeddingBagCollection)
            else module.embedding_configs()
        )
        _quantized_configs(configs, dtypes_for(configs))
    if type(model) in (EmbeddingBagCollection, EmbeddingCollection):
        return convert(model)
    done: Dict[int, nn.Module] = {}

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent._modules.items()):  # every path, aliases included
            if type(child) in (EmbeddingBagCollection, EmbeddingCollection):
                if id(child) not in done:
                    done[id(child)] = convert(child)
                setattr(parent, name, done[id(child)])
            else:
                visit(child)

    visit(model)
    return model
