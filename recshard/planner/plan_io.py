"""Sharding plans as JSON files (checked against a model by `recshard.plan.validate`).

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
from typing import Any, Dict, Optional

from torch import nn

from recshard.plan.validate import PlanValidationError, validate_plan  # noqa: F401 - re-exported
from recshard.types import (
    BoundsCheckMode,
    ParameterSharding,
    ShardingPlan,
    ShardMetadata,
)

PLAN_FORMAT = "recshard.sharding_plan"
PLAN_VERSION = 1


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


def _field(entry: Dict[str, Any], key: str, where: str) -> Any:
    if key not in entry:
        raise PlanValidationError(f"{where}: missing '{key}'")
    return entry[key]


def plan_from_dict(data: Dict[str, Any]) -> ShardingPlan:
    """Inverse of `plan_to_dict`; raises PlanValidationError naming the bad entry."""
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise PlanValidationError(f"not a recshard sharding plan (expected format '{PLAN_FORMAT}')")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise PlanValidationError(
            f"plan schema version {version} is not supported (this recshard reads {PLAN_VERSION})"
        )
    plan: Dict[str, Dict[str, ParameterSharding]] = {}
    for fqn, tables in _field(data, "modules", "plan").items():
        plan[fqn] = {}
        for name, entry in tables.items():
            where = f"table '{f'{fqn}.' if fqn else ''}{name}'"
            shards = _field(entry, "shards", where)
            mode = entry.get("bounds_check_mode")
            plan[fqn][name] = ParameterSharding(
                sharding_type=_field(entry, "sharding_type", where),
                compute_kernel=_field(entry, "compute_kernel", where),
                ranks=entry.get("ranks"),
                shards=None if shards is None else [
                    ShardMetadata(list(_field(s, "offsets", where)), list(_field(s, "sizes", where)),
                                  _field(s, "placement", where))
                    for s in shards
                ],
                bounds_check_mode=BoundsCheckMode(mode) if mode else None,
                cache_params=entry.get("cache_params"),
            )
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


def load_plan(
    path: str,
    module: Optional[nn.Module] = None,
    world_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
) -> ShardingPlan:
    """Read a plan written by `save_plan` or `recshard-plan -o`; with `module`, also check it
    fits that model (and world) with `validate_plan`."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise PlanValidationError(f"{path}: not valid JSON ({e})") from e
    try:
        plan = plan_from_dict(data)
        if module is not None:
            validate_plan(plan, module, world_size, local_world_size)
    except PlanValidationError as e:
        raise PlanValidationError(f"{path}: {e}") from e
    return plan
