"""Sharded state dicts: the unsharded model's keys, sharded tables as ShardedTensors.

A model-parallel table `<path>.embedding_bags.<t>.weight` becomes a ShardedTensor with the
table's global shape and this rank's shards (offsets, sizes, placement from the plan), so
`torch.distributed.checkpoint` can load it into any other plan or world size by reading the
overlapping regions. Data-parallel tables and dense parameters are plain tensors.

Key-value tables' shards come as row pieces of at most `KEY_VALUE_PIECE_BYTES` each, views of
their files, so checkpoints stream them piece by piece.

Fused optimizer state follows the same layout: `<table fqn>.momentum1` is sharded like the
weight (Adagrad) or by rows only (row-wise Adagrad, one value per row). A row-wise state of a
column-sharded table has one accumulator per column shard (`...momentum1@col<offset>`);
`recshard.optim.column_state` converts between column layouts on load.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Dict, Iterator, List, Protocol, Tuple, runtime_checkable

import torch
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)

from recshard.lookup.fused_params import FusedOptimSpec
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import BaseEmbeddingConfig, DataType
from recshard.optim.column_state import column_key
from recshard.plan.sharding_types import COLUMN_SPLIT_TYPES
from recshard.quant.rowwise import BITS, split_fused_rows
from recshard.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)


@contextlib.contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """Silence torch's ShardedTensor deprecation notice where recshard uses it on purpose
    (DTensor cannot place a table-wise shard on one rank of the group): users did not choose
    it and cannot act on it."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*Please use DTensor instead.*", category=FutureWarning
        )
        yield


def _sharded(
    global_size: List[int],
    metas: List[TorchShardMetadata],
    local: List[Tuple[torch.Tensor, TorchShardMetadata]],
    pg: Any,
    dtype: torch.dtype,
    key_value: bool = False,
) -> ShardedTensor:
    """`key_value`: every shard cut into row pieces of at most `KEY_VALUE_PIECE_BYTES` (the
    local pieces are views of the mapped files), so a checkpoint saves and loads the table a
    piece at a time and never holds a whole shard in memory."""
    if key_value:
        metas = [piece for m in metas for piece in _row_pieces(m)]
        local = [
            (
                tensor.narrow(0, piece.shard_offsets[0] - m.shard_offsets[0], piece.shard_sizes[0]),
                piece,
            )
            for tensor, m in local
            for piece in _row_pieces(m)
        ]
    meta = ShardedTensorMetadata(metas, torch.Size(global_size), TensorProperties(dtype=dtype))
    shards = [Shard(tensor.detach(), m) for tensor, m in local]  # views: loads land in place
    with quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, meta, process_group=pg
        )


KEY_VALUE_PIECE_BYTES = 16 << 20  # fp32 values of one state-dict piece of a key_value shard


def _row_pieces(meta: TorchShardMetadata) -> List[TorchShardMetadata]:
    """`meta` cut along rows into pieces of at most `KEY_VALUE_PIECE_BYTES` (a shard without
    rows stays one piece)."""
    rows, rest = meta.shard_sizes[0], meta.shard_sizes[1:]
    step = max(1, KEY_VALUE_PIECE_BYTES // (4 * max(1, math.prod(rest))))
    if rows == 0:
        return [meta]
    first = meta.shard_offsets[0]
    return [
        TorchShardMetadata(
            [first + start, *meta.shard_offsets[1:]],
            [min(step, rows - start), *rest],
            meta.placement,
        )
        for start in range(0, rows, step)
    ]


def _torch_meta(offsets: List[int], sizes: List[int], rank: int) -> TorchShardMetadata:
    return TorchShardMetadata(list(offsets), list(sizes), f"rank:{rank}/cpu")


@runtime_checkable
class ShardedTableState(Protocol):
    """What a sharded collection tells the state walk about its tables (implemented by
    `ShardedEmbeddingModule`); nothing else of the module is read here."""

    env: ShardingEnv

    def table_key(self, table: str) -> str: ...
    def table_configs(self) -> List[BaseEmbeddingConfig]: ...
    def table_plan(self, table: str) -> ParameterSharding: ...
    def local_table_shards(self) -> Dict[str, List[Tuple[LocalTable, torch.Tensor]]]: ...
    def load_full_tables(self, full: Dict[str, torch.Tensor]) -> None: ...
    def local_scale_bias(self) -> Dict[str, List[Tuple[LocalTable, torch.Tensor]]]: ...
    def load_full_quantized(
        self, full: Dict[str, Tuple[torch.Tensor, torch.Tensor | None]]
    ) -> None: ...
    def fused_optim_spec(self, table: str) -> FusedOptimSpec: ...
    def fused_optimizer_states(
        self,
    ) -> Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]]: ...


@runtime_checkable
class ShardedBufferState(Protocol):
    """A sharded module with row-sharded buffers besides its tables (managed collision
    state): ShardedTensors under the unsharded keys, loaded in place."""

    def sharded_buffer_state(self, prefix: str) -> Dict[str, Any]: ...


@runtime_checkable
class EntryState(Protocol):
    """A module with buffers whose length counts entries, not rows (a managed collision
    module's history). A sharded state dict holds the ranks' entries concatenated in rank
    order; a load hands each module the whole saved tensor and it keeps its own entries."""

    def entry_state_names(self) -> List[str]: ...
    def check_entry_state(self, values: Dict[str, torch.Tensor]) -> None: ...
    def load_entry_state(self, values: Dict[str, torch.Tensor]) -> None: ...


def entry_state_keys(model: nn.Module) -> Dict[str, Tuple[EntryState, str]]:
    """Every entry-state key of `model`'s state dict: (its module, the buffer's name)."""
    out: Dict[str, Tuple[EntryState, str]] = {}
    for path, module in model.named_modules():
        if isinstance(module, EntryState):
            for name in module.entry_state_names():
                out[f"{path}.{name}" if path else name] = (module, name)
    return out


def load_entries(
    keys: Dict[str, Tuple[EntryState, str]], values: Dict[str, Any], check_only: bool = False
) -> None:
    """Hand each module its entry state found in `values` (full tensors, or ShardedTensors
    whose local shards are this rank's entries); ValueError if a module refuses it."""
    per_module: Dict[int, Tuple[EntryState, Dict[str, torch.Tensor]]] = {}
    for key, (module, name) in keys.items():
        if key not in values:
            continue
        value = values[key]
        if isinstance(value, ShardedTensor):
            parts = [shard.tensor for shard in value.local_shards()]
            value = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device="cpu")
        per_module.setdefault(id(module), (module, {}))[1][name] = value
    for module, found in per_module.values():
        if check_only:
            module.check_entry_state(found)
        else:
            module.load_entry_state(found)


def entry_sharded_tensor(
    local: torch.Tensor, sizes: List[int], rank: int, pg: Any
) -> ShardedTensor | torch.Tensor:
    """A 1-d buffer of entries: every rank's (`sizes`: each rank's length) concatenated in rank
    order; a plain empty tensor when every rank's is empty."""
    if sum(sizes) == 0:
        return local.detach()
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return row_sharded_tensor(
        local, sum(sizes), [(starts[r], n, r) for r, n in enumerate(sizes) if n], rank, pg
    )


def row_sharded_tensor(
    local: torch.Tensor, global_rows: int, shards: List[Tuple[int, int, int]], rank: int, pg: Any
) -> ShardedTensor:
    """A 1-d buffer cut in rows: `shards` are (row offset, rows, rank), `local` is this rank's
    (a view: loads land in place)."""
    mine = [(local, _torch_meta([o], [n], rank)) for o, n, r in shards if r == rank]
    metas = [_torch_meta([o], [n], r) for o, n, r in shards]
    return _sharded([global_rows], metas, mine, pg, local.dtype)


def _plan_metas(module: ShardedTableState, table: str) -> List[TorchShardMetadata]:
    return [
        _torch_meta(s.shard_offsets, s.shard_sizes, s.rank) for s in module.table_plan(table).shards
    ]


def _local_meta(table: LocalTable, rank: int, per_col: float = 1.0) -> TorchShardMetadata:
    """A local shard's place; `per_col`: stored columns per logical one (packed codes)."""
    return _torch_meta(
        [table.row_offset, int(table.col_offset * per_col)],
        [table.rows, int(table.cols * per_col)],
        rank,
    )


QUANT_SUFFIXES = (".weight", ".weight_qscale", ".weight_qbias")


def _stored_dtype(data_type: DataType) -> torch.dtype:
    """How a table of `data_type` stores its rows (packed codes are bytes)."""
    if data_type in BITS:
        return torch.uint8
    return torch.float16 if data_type == DataType.FP16 else torch.float32


def _is_key_value(module: ShardedTableState, table: str) -> bool:
    return module.table_plan(table).compute_kernel == EmbeddingComputeKernel.KEY_VALUE.value


def table_state(module: ShardedTableState, prefix: str) -> Dict[str, Any]:
    """`{prefix}<table_key>` (`embedding_bags.<t>.weight`) for every table of a sharded
    collection, and for a quantized integer table its `.weight_qscale` / `.weight_qbias`
    (`[rows]`), as the unsharded quantized module names them. A quantized table's packed
    rows are not contiguous in the kernel, so its model-parallel state is a copy: load into
    it with `load_state_dict`."""
    out: Dict[str, Any] = {}
    shards = module.local_table_shards()
    scale_bias = module.local_scale_bias()
    rank = module.env.rank
    for config in module.table_configs():
        key = f"{prefix}{module.table_key(config.name)}"
        local = shards.get(config.name, [])
        plan = module.table_plan(config.name)
        rows = scale_bias.get(config.name, [])
        if plan.sharding_type == ShardingType.DATA_PARALLEL.value:
            out[key] = local[0][1].detach()
            for column, suffix in enumerate(QUANT_SUFFIXES[1:]):
                if rows:
                    out[key + suffix[len(".weight") :]] = rows[0][1][:, column]
            continue
        quant = plan.compute_kernel == "quant"
        per_col = BITS.get(config.data_type, 8) / 8 if quant else 1.0
        out[key] = _sharded(
            [config.num_embeddings, int(config.embedding_dim * per_col)],
            [
                _torch_meta(
                    [s.shard_offsets[0], int(s.shard_offsets[1] * per_col)],
                    [s.shard_sizes[0], int(s.shard_sizes[1] * per_col)],
                    s.rank,
                )
                for s in plan.shards
            ],
            [(w.contiguous(), _local_meta(t, rank, per_col)) for t, w in local],
            module.env.pg,
            local[0][1].dtype if local else _stored_dtype(config.data_type),
            key_value=_is_key_value(module, config.name),
        )
        if not (quant and config.data_type in BITS):
            continue
        row_shards = [s for s in plan.shards if s.shard_offsets[1] == 0]
        metas = [_torch_meta([s.shard_offsets[0]], [s.shard_sizes[0]], s.rank) for s in row_shards]
        for column, suffix in enumerate(QUANT_SUFFIXES[1:]):
            out[key + suffix[len(".weight") :]] = _sharded(
                [config.num_embeddings],
                metas,
                [
                    (r[:, column].contiguous(), _torch_meta([t.row_offset], [t.rows], rank))
                    for t, r in rows
                    if t.col_offset == 0
                ],
                module.env.pg,
                torch.float16,
            )
    return out


def fused_state(module: ShardedTableState, prefix: str) -> Dict[str, Any]:
    """Fused optimizer state of a sharded collection, sharded like its tables."""
    out: Dict[str, Any] = {}
    rank = module.env.rank
    per_table = module.fused_optimizer_states()
    for config in module.table_configs():
        plan = module.table_plan(config.name)
        if plan.sharding_type == ShardingType.DATA_PARALLEL.value or plan.compute_kernel == "dense":
            continue
        base = f"{prefix}{module.table_key(config.name)}"
        local = per_table.get(config.name, [])
        spec = module.fused_optim_spec(config.name)
        key_value = _is_key_value(module, config.name)
        for name in sorted({n for _, s in local for n in s}) or spec.state_names:
            rowwise = spec.rowwise_state
            if not rowwise:
                out[f"{base}.{name}"] = _sharded(
                    [config.num_embeddings, config.embedding_dim],
                    _plan_metas(module, config.name),
                    [(s[name], _local_meta(t, rank)) for t, s in local],
                    module.env.pg,
                    torch.float32,
                    key_value,
                )
            elif ShardingType(plan.sharding_type) in COLUMN_SPLIT_TYPES:
                for shard in plan.shards:
                    mine = [
                        (s[name], _torch_meta([0], [config.num_embeddings], rank))
                        for t, s in local
                        if t.col_offset == shard.shard_offsets[1]
                    ]
                    out[f"{base}.{column_key(name, shard.shard_offsets[1])}"] = _sharded(
                        [config.num_embeddings],
                        [_torch_meta([0], [config.num_embeddings], shard.rank)],
                        mine,
                        module.env.pg,
                        torch.float32,
                        key_value,
                    )
            else:
                metas = [
                    _torch_meta([s.shard_offsets[0]], [s.shard_sizes[0]], s.rank)
                    for s in plan.shards
                ]
                out[f"{base}.{name}"] = _sharded(
                    [config.num_embeddings],
                    metas,
                    [(s[name], _torch_meta([t.row_offset], [t.rows], rank)) for t, s in local],
                    module.env.pg,
                    torch.float32,
                    key_value,
                )
    return out


def _walk(model: nn.Module) -> Tuple[List[Tuple[str, ShardedTableState]], Dict[str, torch.Tensor]]:
    """Sharded tables' modules by path, and the plain parameters/buffers outside them (a
    sharded module that wraps one, holding dense parameters of its own, is walked into)."""
    sharded: List[Tuple[str, ShardedTableState]] = []
    plain: Dict[str, torch.Tensor] = {}
    skip: List[str] = []
    for path, child in model.named_modules():
        if any(path == s or s == "" or path.startswith(s + ".") for s in skip):
            continue
        prefix = f"{path}." if path else ""
        if isinstance(child, ShardedTableState):
            sharded.append((prefix, child))
            skip.append(path)
            continue
        for name, param in child.named_parameters(recurse=False):
            plain[prefix + name] = param
        for name, buf in child.named_buffers(recurse=False):
            if name not in child._non_persistent_buffers_set:
                plain[prefix + name] = buf
    return sharded, plain


def model_state_dict(model: nn.Module, prefix: str = "") -> Dict[str, Any]:
    sharded, plain = _walk(model)
    out = {prefix + k: v.detach() for k, v in plain.items()}
    for path, module in sharded:
        out.update(table_state(module, prefix + path))
        if isinstance(module, ShardedBufferState):
            out.update(module.sharded_buffer_state(prefix + path))
    return out


def fused_optimizer_state(model: nn.Module) -> Dict[str, Any]:
    sharded, _ = _walk(model)
    out: Dict[str, Any] = {}
    for path, module in sharded:
        out.update(fused_state(module, path))
    return out


def load_model_state_dict(
    model: nn.Module, state_dict: Dict[str, Any], strict: bool = True
) -> List[str]:
    """Copy values into the live model: full tensors are sliced per shard, ShardedTensors
    must already be in this model's layout (use `recshard.checkpoint.load` to reshard)."""
    sharded, _ = _walk(model)
    state_dict = _split_torchrec_quant_rows(sharded, state_dict)
    own = model_state_dict(model)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    quantized = _load_quantized(sharded, state_dict)
    entries = entry_state_keys(model)
    load_entries(entries, state_dict, check_only=True)
    with torch.no_grad():
        for key, target in own.items():
            if key not in state_dict or key in quantized or key in entries:
                continue
            value = state_dict[key]
            if isinstance(target, ShardedTensor):
                if isinstance(value, ShardedTensor):
                    for dst, src in zip(target.local_shards(), value.local_shards()):
                        dst.tensor.copy_(src.tensor)
                elif key.endswith(".weight"):
                    _load_full(sharded, key, value)
                else:  # a row-sharded buffer: this rank's rows of the full tensor
                    for shard in target.local_shards():
                        start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                        shard.tensor.copy_(value[start : start + rows])
            else:
                if tuple(target.shape) != tuple(value.shape):
                    raise ValueError(
                        f"'{key}': checkpoint shape {tuple(value.shape)} != model "
                        f"shape {tuple(target.shape)}"
                    )
                target.copy_(value)
    load_entries(entries, state_dict)
    return missing


def _load_full(sharded: List[Tuple[str, ShardedTableState]], key: str, value: torch.Tensor) -> None:
    for path, module in sharded:
        for config in module.table_configs():
            if key == path + module.table_key(config.name):
                module.load_full_tables({config.name: value})
                return


def _split_torchrec_quant_rows(
    sharded: List[Tuple[str, ShardedTableState]], state_dict: Dict[str, Any]
) -> Dict[str, Any]:
    """`state_dict` with each quantized table given in TorchRec's layout (`.weight` = fbgemm's
    whole rows, no `.weight_qscale`) split into recshard's three keys (`split_fused_rows`)."""
    out = state_dict
    for path, module in sharded:
        for config in module.table_configs():
            if module.table_plan(config.name).compute_kernel != "quant":
                continue
            key = f"{path}{module.table_key(config.name)}"
            rows = state_dict.get(key)
            if not isinstance(rows, torch.Tensor) or isinstance(rows, ShardedTensor):
                continue
            fused = split_fused_rows(rows, config.embedding_dim, config.data_type)
            if fused is None or f"{key}_qscale" in state_dict:
                continue
            out = dict(out) if out is state_dict else out
            out[key], out[f"{key}_qscale"], out[f"{key}_qbias"] = (
                fused[0],
                fused[1][:, 0],
                fused[1][:, 1],
            )
    return out


def _load_quantized(
    sharded: List[Tuple[str, ShardedTableState]], state_dict: Dict[str, Any]
) -> List[str]:
    """Load the model-parallel quantized tables given as full tensors (an unsharded quantized
    module's state: `.weight` codes with `.weight_qscale` / `.weight_qbias`); the keys used."""
    used: List[str] = []
    for path, module in sharded:
        full: Dict[str, Tuple[torch.Tensor, torch.Tensor | None]] = {}
        for config in module.table_configs():
            plan = module.table_plan(config.name)
            if plan.compute_kernel != "quant" or plan.sharding_type == "data_parallel":
                continue
            base = f"{path}{module.table_key(config.name)}"
            keys = [base + suffix[len(".weight") :] for suffix in QUANT_SUFFIXES]
            if config.data_type not in BITS:
                keys = keys[:1]
            given = [state_dict.get(k) for k in keys]
            if given[0] is None:
                continue
            if any(v is None or isinstance(v, ShardedTensor) for v in given):
                raise ValueError(
                    f"table '{config.name}': a sharded quantized table loads from full "
                    f"tensors {keys} (an unsharded quantized module's state_dict); got "
                    f"{[type(v).__name__ for v in given]}"
                )
            scale_bias = torch.stack(given[1:], dim=1) if len(given) == 3 else None
            full[config.name] = (given[0], scale_bias)
            used += keys
        if full:
            module.load_full_quantized(full)
    return used
