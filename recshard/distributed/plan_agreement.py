"""Every rank wraps the same model with the same plan: checked when DistributedModelParallel
is built, before any module is sharded (sharding starts collectives of its own, which ranks
with different plans would pair wrongly or never join).

Each rank describes what it is about to shard as flat `{item: value}` text: the plan's module
paths; per module its tables (plan and model), whether it is weighted, and per table the
plan's sharding (type, kernel, ranks, shards, bounds-check mode, cache params), the config
(rows, dim, pooling, features, data type) and the fused params (the sharder's, overridden by
an optimizer attached to the table; settings that are each rank's own, such as
`ssd_storage_directory`, are left out). The ranks all-gather a SHA-256 of it (32 bytes each);
only when the digests differ do they gather the descriptions themselves, and every rank
raises the same ValueError naming each item that differs and every rank's value.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from recshard.optim.apply_optimizer_in_backward import fused_params_for
from recshard.plan.module_tables import embedding_tables
from recshard.types import ModuleSharder, ShardingPlan

# fused params that name something of the rank's own machine: they may differ between ranks
RANK_LOCAL_FUSED_PARAMS = frozenset({"ssd_storage_directory"})
CONFIG_FIELDS = ("num_embeddings", "embedding_dim", "pooling", "feature_names", "data_type")
SHARDING_FIELDS = (
    "sharding_type",
    "compute_kernel",
    "ranks",
    "shards",
    "bounds_check_mode",
    "cache_params",
)
FIRST = ("plan error", "plan modules")  # listed before the per-table items
MAX_LISTED = 12  # differences named in the error; the count says how many more
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _text(value: Any) -> str:
    """A value as text that is the same on every rank for equal values (dicts by key; an
    object's address, which differs by process, left out)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_text(v)}" for k, v in sorted(value.items())) + "}"
    return _ADDRESS.sub("", repr(value))


def _configs(module: nn.Module) -> List[Any]:
    found = embedding_tables(module)
    return [] if found is None else list(found[0])


def describe(
    module: nn.Module, plan: ShardingPlan, sharder_map: Dict[type, ModuleSharder]
) -> Dict[str, str]:
    """What this rank will shard, as `{item: value}` (paths the plan names must exist)."""
    modules = dict(module.named_modules())
    items = {"plan modules": _text(sorted(plan.plan))}
    for path in sorted(plan.plan):
        tables = plan.plan[path]
        target = modules[path]
        sharder = sharder_map[type(target)]
        where = f"module '{path}'"
        weights = sharder.shardable_parameters(target)
        configs = {c.name: c for c in _configs(target)}
        items[f"{where} tables in the plan"] = _text(sorted(tables))
        items[f"{where} tables in the model"] = _text(sorted(weights))
        if hasattr(target, "is_weighted"):
            items[f"{where} is_weighted"] = _text(target.is_weighted())
        for name in sorted(set(tables) | set(weights)):
            table = f"{where} table '{name}'"
            if name in weights:
                items[f"{table} shape"] = _text(tuple(weights[name].shape))
                try:
                    fused = fused_params_for(weights[name], sharder.fused_params, name)
                except ValueError as e:  # raised again, on every rank, when it is sharded
                    fused = {"error": str(e)}
                shared = {k: v for k, v in fused.items() if k not in RANK_LOCAL_FUSED_PARAMS}
                items[f"{table} fused params"] = _text(shared)
            if name in configs:
                for field in CONFIG_FIELDS:
                    items[f"{table} {field}"] = _text(getattr(configs[name], field, None))
            if name in tables:
                for field in SHARDING_FIELDS:
                    items[f"{table} {field}"] = _text(getattr(tables[name], field, None))
    return items


def _digest(items: Dict[str, str]) -> torch.Tensor:
    """`[4]` int64: the SHA-256 of `items`."""
    data = hashlib.sha256(json.dumps(items, sort_keys=True).encode("utf-8")).digest()
    return torch.frombuffer(bytearray(data), dtype=torch.int64).clone()


def differences(per_rank: List[Dict[str, str]]) -> List[str]:
    """`item: rank 0 value, rank 1 value, ...` for every item whose value differs by rank
    (a missing item reads `<absent>`)."""
    seen = dict.fromkeys(item for items in per_rank for item in items)  # modules, then tables
    lines = []
    for item in sorted(seen, key=lambda item: item not in FIRST):
        values = [d.get(item, "<absent>") for d in per_rank]
        if len(set(values)) > 1:
            lines.append(f"{item}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    return lines


def check_ranks_agree(
    items: Dict[str, str], pg: dist.ProcessGroup | None, device: torch.device
) -> None:
    """ValueError on every rank of `pg` unless every rank passed the same `items`."""
    if pg is None or not dist.is_initialized() or dist.get_world_size(pg) == 1:
        return
    mine = _digest(items)
    if dist.get_backend(pg) == "nccl":  # NCCL needs device tensors; gloo takes host ones
        mine = mine.to(device)
    digests = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(digests, mine, group=pg)
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    per_rank: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(per_rank, items, group=pg)
    lines = differences(per_rank)
    more = f"\n  ... and {len(lines) - MAX_LISTED} more" if len(lines) > MAX_LISTED else ""
    raise ValueError(
        "DistributedModelParallel: the ranks were given different plans or models (every rank "
        "must wrap the same model with the same plan); they differ in:\n  "
        + "\n  ".join(lines[:MAX_LISTED])
        + more
    )
