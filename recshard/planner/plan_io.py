"""Sharding plans as JSON files (checked against a model by `recshard.plan.validate`).

Schema (version 1)::

    {"format": "recshard.sharding_plan", "version": 1,
     "metadata": {...},                              # free-form (world size, planner stats)
     "modules": {"<module fqn>": {"<table>": {
         "sharding_type": "column_wise", "compute_kernel": "fused", "ranks": [0, 1],
         "shards": [{"offsets": [0, 0], "sizes": [1000, 32], "placement": "rank:0/cpu"}, ...],
         "bounds_check_mode": null, "cache_params": null}}}}

`shards` is null for data-parallel tables (every rank holds the whole table). `cache_params`
is null or the JSON form of a `CacheParams` (`cache_params_to_dict`: without its `stats`,
which are an object).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List

from torch import nn

from recshard.plan.validate import (  # noqa: F401 - PlanValidationError, validate_plan re-exported
    PlanValidationError,
    check_ranks_agree,
    validate_plan,
)
from recshard.planner.cache_params_json import cache_params_from_dict, cache_params_to_dict
from recshard.planner.json_input import (
    InputLimitError,
    check_table_count,
    parse_json,
    read_bounded,
)
from recshard.types import (
    BoundsCheckMode,
    CacheParams,
    ParameterSharding,
    ShardingPlan,
    ShardMetadata,
)

PLAN_FORMAT = "recshard.sharding_plan"
PLAN_VERSION = 1


def plan_to_dict(plan: ShardingPlan, metadata: Dict[str, Any] | None = None) -> Dict[str, Any]:
    """The JSON-ready dict of `plan` (schema in the module docstring)."""
    modules: Dict[str, Any] = {}
    for fqn, tables in plan.plan.items():
        modules[fqn] = {}
        for name, ps in tables.items():
            modules[fqn][name] = {
                "sharding_type": getattr(ps.sharding_type, "value", ps.sharding_type),
                "compute_kernel": getattr(ps.compute_kernel, "value", ps.compute_kernel),
                "ranks": list(ps.ranks) if ps.ranks is not None else None,
                "shards": None
                if ps.shards is None
                else [
                    {
                        "offsets": list(s.shard_offsets),
                        "sizes": list(s.shard_sizes),
                        "placement": s.placement,
                    }
                    for s in ps.shards
                ],
                "bounds_check_mode": ps.bounds_check_mode.value if ps.bounds_check_mode else None,
                "cache_params": cache_params_to_dict(ps.cache_params),
            }
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "metadata": metadata or {},
        "modules": modules,
    }


_PLACEMENT = re.compile(r"rank:(\d+)/[A-Za-z]+(?::\d+)?")


def _field(entry: Any, key: str, where: str, kind: type | None = None) -> Any:
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
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise PlanValidationError(f"{where}: expected a list of integers >= 0, got {value!r:.60}")
    return value


def _shards(raw: Any, where: str) -> List[ShardMetadata] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise PlanValidationError(f"{where}.shards: expected a list or null, got {raw!r:.60}")
    shards = []
    for k, s in enumerate(raw):
        at = f"{where}.shards[{k}]"
        placement = _field(s, "placement", at, str)
        if not _PLACEMENT.fullmatch(placement):
            raise PlanValidationError(
                f"{at}.placement: expected 'rank:<r>/<device>', got {placement!r:.60}"
            )
        shards.append(
            ShardMetadata(
                _ints(_field(s, "offsets", at), f"{at}.offsets"),
                _ints(_field(s, "sizes", at), f"{at}.sizes"),
                placement,
            )
        )
    return shards


def _table_entry(entry: Any, where: str) -> ParameterSharding:
    shards = _shards(_field(entry, "shards", where), where)
    ranks = entry.get("ranks")
    if ranks is not None:
        ranks = _ints(ranks, f"{where}.ranks")
        if shards is not None:
            check_ranks_agree(f"{where}.ranks", ranks, shards)
    mode = entry.get("bounds_check_mode")
    try:
        bounds = BoundsCheckMode(mode) if mode else None
    except ValueError:
        raise PlanValidationError(
            f"{where}.bounds_check_mode: {mode!r:.40} is not one of "
            f"{[m.value for m in BoundsCheckMode]}"
        ) from None
    return ParameterSharding(
        sharding_type=_field(entry, "sharding_type", where, str),
        compute_kernel=_field(entry, "compute_kernel", where, str),
        ranks=ranks,
        shards=shards,
        bounds_check_mode=bounds,
        cache_params=_cache_params(entry.get("cache_params"), f"{where}.cache_params"),
    )


def _cache_params(raw: Any, where: str) -> CacheParams | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise PlanValidationError(f"{where}: expected an object, got {type(raw).__name__}")
    try:
        return cache_params_from_dict(raw)
    except ValueError as e:
        raise PlanValidationError(f"{where}: {e}") from None


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
    modules = _field(data, "modules", "$", dict)
    check_table_count(sum(len(t) for t in modules.values() if isinstance(t, dict)))
    for fqn, tables in modules.items():
        if not isinstance(tables, dict):
            raise PlanValidationError(
                f"$.modules[{json.dumps(fqn)}]: expected an object of tables, got {tables!r:.60}"
            )
        plan[fqn] = {}
        for name, entry in tables.items():
            try:
                plan[fqn][name] = _table_entry(
                    entry, f"$.modules[{json.dumps(fqn)}][{json.dumps(name)}]"
                )
            except PlanValidationError as e:
                raise PlanValidationError(
                    f"table '{f'{fqn}.' if fqn else ''}{name}': {e}"
                ) from None
    return ShardingPlan(plan)


def save_plan(plan: ShardingPlan, path: str, metadata: Dict[str, Any] | None = None) -> None:
    """Write `plan` as JSON to `path` (written to a temp file, then renamed)."""
    data = plan_to_dict(plan, metadata)
    lines = [
        "{",
        f' "format": {json.dumps(data["format"])},',
        f' "version": {data["version"]},',
        f' "metadata": {json.dumps(data["metadata"], sort_keys=True)},',
        ' "modules": {',
    ]
    modules = list(data["modules"].items())
    for m, (fqn, tables) in enumerate(modules):
        lines.append(f"  {json.dumps(fqn)}: {{")
        items = list(tables.items())
        for t, (name, entry) in enumerate(items):  # one line per table keeps big plans small
            comma = "," if t + 1 < len(items) else ""
            lines.append(
                f"   {json.dumps(name)}: {json.dumps(entry, separators=(',', ':'))}{comma}"
            )
        lines.append("  }" + ("," if m + 1 < len(modules) else ""))
    lines += [" }", "}", ""]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)


def load_plan(
    path: str,
    module: nn.Module | None = None,
    world_size: int | None = None,
    local_world_size: int | None = None,
) -> ShardingPlan:
    """Read a plan written by `save_plan` or `recshard-plan -o`; with `module`, also check it
    fits that model (and world) with `validate_plan`."""
    try:
        data = parse_json(read_bounded(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanValidationError(f"{path}: not valid JSON ({e})") from None
    except InputLimitError as e:
        raise InputLimitError(f"{path}: {e}") from None
    try:
        plan = plan_from_dict(data)
        if module is not None:
            validate_plan(plan, module, world_size, local_world_size)
    except PlanValidationError as e:
        raise PlanValidationError(f"{path}: {e}") from e
    except InputLimitError as e:
        raise InputLimitError(f"{path}: {e}") from None
    return plan
