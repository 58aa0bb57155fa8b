"""Sharded state dicts: the unsharded model's keys, sharded tables as ShardedTensors.

A model-parallel table `<path>.embedding_bags.<t>.weight` becomes a ShardedTensor with the
table's global shape and this rank's shards (offsets, sizes, placement from the plan), so
`torch.distributed.checkpoint` can load it into any other plan or world size by reading the
overlapping regions. Data-parallel tables and dense parameters are plain tensors.

Key-value tables' shards come as row pieces of at most `KEY_VALUE_PIECE_BYTES` each, views of
their files, so checkpoints stream them piece by piece.

Fused optimizer state follows the same layout: `<table fqn>.momentum1` is sharded like the
weight (Adagrad) or by rows only (row-wise Adagrad, one value per row). A row-wise state of a
column-sharded table has one accumulator per column shard (`...momentum1@col<offset>`); those
do not convert to other layouts.
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
from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.plan.sharding_types import COLUMN_SPLIT_TYPES
from recshard.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardedModule,
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

    @property
    def tables_attr(self) -> str: ...
    def table_configs(self) -> List[BaseEmbeddingConfig]: ...
    def table_plan(self, table: str) -> ParameterSharding: ...
    def local_table_shards(self) -> Dict[str, List[Tuple[LocalTable, torch.Tensor]]]: ...
    def load_full_tables(self, full: Dict[str, torch.Tensor]) -> None: ...
    def fused_optim_spec(self, table: str) -> FusedOptimSpec: ...
    def fused_optimizer_states(
        self,
    ) -> Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]]: ...


def _plan_metas(module: ShardedTableState, table: str) -> List[TorchShardMetadata]:
    return [
        _torch_meta(s.shard_offsets, s.shard_sizes, s.rank) for s in module.table_plan(table).shards
    ]


def _local_meta(table: LocalTable, rank: int) -> TorchShardMetadata:
    return _torch_meta([table.row_offset, table.col_offset], [table.rows, table.cols], rank)


def _is_key_value(module: ShardedTableState, table: str) -> bool:
    return module.table_plan(table).compute_kernel == EmbeddingComputeKernel.KEY_VALUE.value


def table_state(module: ShardedTableState, prefix: str) -> Dict[str, Any]:
    """`{prefix}<tables_attr>.<t>.weight` for every table of a sharded collection."""
    out: Dict[str, Any] = {}
    shards = module.local_table_shards()
    rank = module.env.rank
    for config in module.table_configs():
        key = f"{prefix}{module.tables_attr}.{config.name}.weight"
        local = shards.get(config.name, [])
        if module.table_plan(config.name).sharding_type == ShardingType.DATA_PARALLEL.value:
            out[key] = local[0][1].detach()
            continue
        out[key] = _sharded(
            [config.num_embeddings, config.embedding_dim],
            _plan_metas(module, config.name),
            [(w, _local_meta(t, rank)) for t, w in local],
            module.env.pg,
            local[0][1].dtype if local else torch.float32,
            key_value=_is_key_value(module, config.name),
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
        base = f"{prefix}{module.tables_attr}.{config.name}.weight"
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
                    out[f"{base}.{name}@col{shard.shard_offsets[1]}"] = _sharded(
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
    """Sharded modules by path, and the plain parameters/buffers outside them."""
    sharded: List[Tuple[str, ShardedTableState]] = []
    plain: Dict[str, torch.Tensor] = {}
    skip: List[str] = []
    for path, child in model.named_modules():
        if any(path == s or s == "" or path.startswith(s + ".") for s in skip):
            continue
        prefix = f"{path}." if path else ""
        if isinstance(child, ShardedModule):
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
    own = model_state_dict(model)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    sharded, _ = _walk(model)
    with torch.no_grad():
        for key, target in own.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if isinstance(target, ShardedTensor):
                if isinstance(value, ShardedTensor):
                    for dst, src in zip(target.local_shards(), value.local_shards()):
                        dst.tensor.copy_(src.tensor)
                else:
                    _load_full(sharded, key, value)
            else:
                if tuple(target.shape) != tuple(value.shape):
                    raise ValueError(
                        f"'{key}': checkpoint shape {tuple(value.shape)} != model "
                        f"shape {tuple(target.shape)}"
                    )
                target.copy_(value)
    return missing


def _load_full(sharded: List[Tuple[str, ShardedTableState]], key: str, value: torch.Tensor) -> None:
    for path, module in sharded:
        head = f"{path}{module.tables_attr}."
        if key.startswith(head) and key.endswith(".weight"):
            module.load_full_tables({key[len(head) : -len(".weight")]: value})
            return
