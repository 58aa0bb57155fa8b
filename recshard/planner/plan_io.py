"""Sharding plans as JSON files, and checking a plan against a model.

Schema (version 1)::

    {"format": "recshard.sharding_plan", "version": 1,
     "metadata": {...},                              # free-form (world size, planner stats)
     "modules": {"<module fqn>": {"<table>": {
         "sharding_type": "column_wise", "compute_kernel": "fused", "ranks": [0, 1],
         "shards": [{"offsets": [0, 0], "sizes": [1000, 32], "placement": "rank:0/cpu"}, ...],
         "bounds_check_mode": null, "cache_params": null}}}}

`shards` is null for data-parallel tables (every rank holds the whole table).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from recshard.planner.types import ALL_SHARDING_TYPES
from recshard.types import (
    BoundsCheckMode,
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingPlan,
    ShardMetadata,
)

PLAN_FORMAT = "recshard.sharding_plan"
PLAN_VERSION = 1
_KERNELS = [k.value for k in EmbeddingComputeKernel]


class PlanValidationError(ValueError):
    """A plan does not match the model or the world it is used with; names the table."""


def plan_to_dict(plan: ShardingPlan, metadata: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The JSON-ready dict of `plan` (schema in the module docstring)."""
    modules: Dict[str, Any] = {}
    for fqn, tables in plan.plan.items():
        modules[fqn] = {}
        for name, ps in tables.items():
            modules[fqn][name] = {
                "sharding_type": getattr(ps.sharding_type, "value", ps.sharding_type),
                "compute_kernel": getattr(ps.compute_kernel, "value", ps.compute_kernel),
                "ranks": list(ps.ranks) if ps.ranks is not None else None,
                "shards": None if ps.shards is None else [
                    {"offsets": list(s.shard_offsets), "sizes": list(s.shard_sizes),
                     "placement": s.placement} for s in ps.shards
                ],
                "bounds_check_mode": ps.bounds_check_mode.value if ps.bounds_check_mode else None,
                "cache_params": ps.cache_params,
            }
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "metadata": metadata or {},
            "modules": modules}


_PLACEMENT = re.compile(r"rank:(\d+)/[A-Za-z]+(?::\d+)?")


def _field(entry: Any, key: str, where: str, kind: Optional[type] = None) -> Any:
    """`entry[key]`, which must be there (and of `kind`); errors name the JSON path."""
    if not isinstance(entry, dict):
        raise PlanValidationError(f"{where}: expected an object, got {type(entry).__name__}")
    if key not in entry:
        raise PlanValidationError(f"{where}: missing '{key}'")
    value = entry[key]
    if kind is not None and not isinstance(value, kind):
        raise PlanValidationError(f"{where}.{key}: expected {kind.__name__}, got {value!r:.60}")
    return value


def _ints(value: Any, where: str) -> List[int]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise PlanValidationError(f"{where}: expected a list of integers >= 0, got {value!r:.60}")
    return value


def _shards(raw: Any, where: str) -> Optional[List[ShardMetadata]]:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise PlanValidationError(f"{where}.shards: expected a list or null, got {raw!r:.60}")
    shards = []
    for k, s in enumerate(raw):
        at = f"{where}.shards[{k}]"
        placement = _field(s, "placement", at, str)
        if not _PLACEMENT.fullmatch(placement):
            raise PlanValidationError(f"{at}.placement: expected 'rank:<r>/<device>', got "
                                      f"{placement!r:.60}")
        shards.append(ShardMetadata(_ints(_field(s, "offsets", at), f"{at}.offsets"),
                                    _ints(_field(s, "sizes", at), f"{at}.sizes"), placement))
    return shards


def _table_entry(entry: Any, where: str) -> ParameterSharding:
    shards = _shards(_field(entry, "shards", where), where)
    ranks = entry.get("ranks")
    if ranks is not None:
        ranks = _ints(ranks, f"{where}.ranks")
        placed = sorted({int(_PLACEMENT.fullmatch(s.placement).group(1))  # type: ignore[union-attr]
                         for s in shards or []})
        if shards is not None and sorted(set(ranks)) != placed:
            raise PlanValidationError(f"{where}.ranks: {ranks} do not agree with the shards' "
                                      f"placements (ranks {placed})")
    mode = entry.get("bounds_check_mode")
    try:
        bounds = BoundsCheckMode(mode) if mode else None
    except ValueError:
        raise PlanValidationError(
            f"{where}.bounds_check_mode: {mode!r:.40} is not one of "
            f"{[m.value for m in BoundsCheckMode]}") from None
    return ParameterSharding(
        sharding_type=_field(entry, "sharding_type", where, str),
        compute_kernel=_field(entry, "compute_kernel", where, str),
        ranks=ranks, shards=shards, bounds_check_mode=bounds,
        cache_params=entry.get("cache_params"),
    )


def plan_from_dict(data: Dict[str, Any]) -> ShardingPlan:
    """Inverse of `plan_to_dict`; raises PlanValidationError naming the bad entry by its JSON
    path and table."""
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise PlanValidationError(f"not a recshard sharding plan (expected format '{PLAN_FORMAT}')")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise PlanValidationError(
            f"plan schema version {version} is not supported (this recshard reads {PLAN_VERSION})"
        )
    plan: Dict[str, Dict[str, ParameterSharding]] = {}
    for fqn, tables in _field(data, "modules", "$", dict).items():
        if not isinstance(tables, dict):
            raise PlanValidationError(f"$.modules[{json.dumps(fqn)}]: expected an object of "
                                      f"tables, got {tables!r:.60}")
        plan[fqn] = {}
        for name, entry in tables.items():
            try:
                plan[fqn][name] = _table_entry(
                    entry, f"$.modules[{json.dumps(fqn)}][{json.dumps(name)}]")
            except PlanValidationError as e:
                raise PlanValidationError(f"table '{f'{fqn}.' if fqn else ''}{name}': {e}") \
                    from None
    return ShardingPlan(plan)


def save_plan(plan: ShardingPlan, path: str, metadata: Optional[Dict[str, Any]] = None) -> None:
    """Write `plan` as JSON to `path` (written to a temp file, then renamed)."""
    data = plan_to_dict(plan, metadata)
    lines = ["{", f' "format": {json.dumps(data["format"])},', f' "version": {data["version"]},',
             f' "metadata": {json.dumps(data["metadata"], sort_keys=True)},', ' "modules": {']
    modules = list(data["modules"].items())
    for m, (fqn, tables) in enumerate(modules):
        lines.append(f"  {json.dumps(fqn)}: {{")
        items = list(tables.items())
        for t, (name, entry) in enumerate(items):  # one line per table keeps big plans small
            comma = "," if t + 1 < len(items) else ""
            lines.append(f"   {json.dumps(name)}: {json.dumps(entry, separators=(',', ':'))}{comma}")
        lines.append("  }" + ("," if m + 1 < len(modules) else ""))
    lines += [" }", "}", ""]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)


def load_plan(path: str) -> ShardingPlan:
    """Read a plan written by `save_plan` or `recshard-plan -o`."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanValidationError(f"{path}: not valid JSON ({e})") from None
    try:
        return plan_from_dict(data)
    except PlanValidationError as e:
        raise PlanValidationError(f"{path}: {e}") from e


def _module_tables(module: nn.Module) -> Dict[str, Dict[str, Tuple[int, int]]]:
    """Per embedding-module FQN, table name -> (rows, cols)."""
    found: Dict[str, Dict[str, Tuple[int, int]]] = {}
    for fqn, mod in module.named_modules():
        configs = None
        if hasattr(mod, "embedding_bag_configs"):
            configs = mod.embedding_bag_configs()
        elif hasattr(mod, "embedding_configs"):
            configs = mod.embedding_configs()
        if configs is not None:
            found[fqn] = {c.name: (c.num_embeddings, c.embedding_dim) for c in configs}
    return found


def _check_cover(where: str, ps: ParameterSharding, rows: int, cols: int) -> None:
    shards = ps.shards or []
    if not shards:
        raise PlanValidationError(f"{where}: {ps.sharding_type} needs shards, the plan has none")
    row_wise = ps.sharding_type in ("row_wise", "table_row_wise")
    axis = 0 if row_wise else 1
    extent = rows if row_wise else cols
    other = cols if row_wise else rows
    position = 0
    for s in shards:
        if s.shard_offsets[1 - axis] != 0 or s.shard_sizes[1 - axis] != other:
            raise PlanValidationError(f"{where}: shard {s} does not span the full "
                                      f"{'columns' if row_wise else 'rows'} of {rows} x {cols}")
        if s.shard_offsets[axis] != position:
            raise PlanValidationError(f"{where}: shard {s} starts at {s.shard_offsets[axis]}, "
                                      f"expected {position} (gap or overlap)")
        position += s.shard_sizes[axis]
    if position != extent:
        raise PlanValidationError(
            f"{where}: shards cover {position} {'rows' if row_wise else 'columns'}, the table "
            f"has {extent} ({rows} x {cols})"
        )


def validate_plan(
    plan: ShardingPlan,
    module: nn.Module,
    world_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
) -> None:
    """Check that `plan` fits `module`: every planned module and table exists, every table of a
    planned module is planned, shards tile each table exactly, kernels and types are known,
    ranks are below `world_size` and table-row/column-wise shards stay in one host of
    `local_world_size` ranks. Raises PlanValidationError naming the table."""
    tables = _module_tables(module)
    for fqn, planned in plan.plan.items():
        if fqn not in tables:
            raise PlanValidationError(
                f"plan names module '{fqn}', which the model does not have; embedding modules: "
                f"{sorted(tables)}"
            )
        missing = sorted(set(tables[fqn]) - set(planned))
        if missing:
            raise PlanValidationError(f"module '{fqn}': tables {missing} have no entry in the plan")
        for name, ps in planned.items():
            where = f"table '{f'{fqn}.' if fqn else ''}{name}'"
            if name not in tables[fqn]:
                raise PlanValidationError(
                    f"{where} is in the plan but not in the model; module '{fqn}' has tables "
                    f"{sorted(tables[fqn])}"
                )
            _validate_entry(where, ps, *tables[fqn][name], world_size, local_world_size)


def _validate_entry(where: str, ps: ParameterSharding, rows: int, cols: int,
                    world_size: Optional[int], local_world_size: Optional[int]) -> None:
    st = getattr(ps.sharding_type, "value", ps.sharding_type)
    kernel = getattr(ps.compute_kernel, "value", ps.compute_kernel)
    if st not in ALL_SHARDING_TYPES:
        raise PlanValidationError(f"{where}: unknown sharding type {st!r}")
    if kernel not in _KERNELS:
        raise PlanValidationError(f"{where}: unknown compute kernel {kernel!r}")
    ranks: List[int] = list(ps.ranks or [])
    if st != "data_parallel":
        if st == "table_wise" and len(ps.shards or []) != 1:
            raise PlanValidationError(f"{where}: table-wise needs exactly one shard")
        _check_cover(where, ps, rows, cols)
        shard_ranks = [s.rank for s in ps.shards or []]
        if local_world_size and st in ("table_row_wise", "table_column_wise"):
            hosts = sorted({r // local_world_size for r in shard_ranks})
            if len(hosts) != 1:
                raise PlanValidationError(f"{where}: {st} shards span hosts {hosts} "
                                          f"(local_world_size {local_world_size})")
        ranks += shard_ranks
    if world_size is not None:
        bad = sorted({r for r in ranks if not 0 <= r < world_size})
        if bad:
            raise PlanValidationError(f"{where}: ranks {bad} are outside world size {world_size}")
