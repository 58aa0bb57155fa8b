"""The tables file `recshard-plan` plans from: JSON (or YAML when PyYAML is installed), a list
of tables or {"tables": [...], "optimizer": ..., "batch_size": ..., "world_size": ...}, read
within `json_input`'s limits into table metadata and constraints. Errors name the table and
key; a number out of range is a `NumberError`."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Tuple

from recshard.planner.json_input import (
    MAX_DEPTH,
    InputLimitError,
    check_depth,
    check_table_count,
    parse_json,
    read_bounded,
)
from recshard.planner.planner_types import ParameterConstraints, TableMeta
from recshard.types import BoundsCheckMode

_TABLE_KEYS = {
    "name",
    "num_embeddings",
    "embedding_dim",
    "feature_names",
    "pooling_factor",
    "pooling_factors",
    "num_poolings",
    "batch_sizes",
    "data_type",
    "weighted",
    "is_weighted",
    "pooled",
    "module",
    "optimizer",
    "constraints",
}
_CONSTRAINT_KEYS = {
    "sharding_types",
    "compute_kernels",
    "min_partition",
    "enforce_hbm",
    "cache_params",
    "bounds_check_mode",
    "stochastic_rounding",
    "batch_sizes",
    "pooling_factors",
    "num_poolings",
}


class InputError(ValueError):
    """The tables file is malformed; the message names the table and key."""


class NumberError(InputError):
    """A number in the tables file is not finite or out of its range, or the file is over
    the planner's limits (exit status 2)."""


def read_tables_file(path: str) -> Dict[str, Any]:
    """Parse the tables file (JSON, or YAML if PyYAML is importable) into a dict, within the
    limits of `json_input`. Errors do not repeat the path (`main` prefixes it)."""
    try:
        return _read_tables_file(path)
    except InputLimitError as e:
        raise NumberError(str(e)) from None


def _read_tables_file(path: str) -> Dict[str, Any]:
    raw = read_bounded(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r})"
        ) from None
    try:
        data = parse_json(text)
    except json.JSONDecodeError as json_error:
        if path.endswith(".json") or text.lstrip()[:1] in ("{", "["):
            raise InputError(f"not valid JSON: {json_error}") from None
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise InputError(
                f"not valid JSON ({json_error}); install PyYAML to read YAML"
            ) from None
        try:
            data = yaml.safe_load(text)
        except RecursionError:
            raise InputLimitError(f"nested more than {MAX_DEPTH} levels deep") from None
        except yaml.YAMLError as e:
            raise InputError(
                f"neither JSON ({json_error}) nor YAML ({' '.join(str(e).split())})"
            ) from None
        check_depth(data)
    if isinstance(data, list):
        data = {"tables": data}
    if not isinstance(data, dict) or not isinstance(data.get("tables"), list):
        raise InputError("expected a list of tables or an object with a 'tables' list")
    if not data["tables"]:
        raise InputError("the table list is empty: nothing to plan")
    check_table_count(len(data["tables"]))
    return data


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _per_feature(
    value: Any, n: int, key: str, name: str, integer: bool = False
) -> List[Any] | None:
    """Per-feature values (a scalar applies to every feature); each a finite number > 0
    (`integer`: an integer >= 1)."""
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise InputError(f"table '{name}': '{key}' has {len(values)} values for {n} features")
    for v in values:
        number = is_int(v) or (isinstance(v, float) and not integer)
        if not number or not math.isfinite(v) or v <= 0:
            kind = "integers >= 1" if integer else "finite numbers > 0"
            raise NumberError(f"table '{name}': '{key}' must be {kind}, got {v!r}")
    return values


def _feature_names(entry: Dict[str, Any], name: str) -> List[str]:
    features = entry.get("feature_names")
    if features is None:
        return [name]
    if (
        not isinstance(features, list)
        or not features
        or not all(isinstance(f, str) and f for f in features)
    ):
        raise InputError(
            f"table '{name}': 'feature_names' must be a non-empty list of "
            f"names, got {features!r:.80}"
        )
    return features


def parse_tables(
    data: Dict[str, Any], default_optimizer: str | None = None
) -> Tuple[List[TableMeta], Dict[str, ParameterConstraints]]:
    """Table metadata and constraints from the parsed tables file."""
    tables: List[TableMeta] = []
    constraints: Dict[str, ParameterConstraints] = {}
    optimizer = data.get("optimizer", default_optimizer)
    for index, entry in enumerate(data["tables"]):
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("name"), str)
            or not entry["name"]
        ):
            raise InputError(f"table #{index}: needs an object with a 'name' string")
        name = entry["name"]
        unknown = sorted(set(entry) - _TABLE_KEYS)
        if unknown:
            raise InputError(
                f"table '{name}': unknown keys {unknown}; known: {sorted(_TABLE_KEYS)}"
            )
        for key in ("num_embeddings", "embedding_dim"):
            if not is_int(entry.get(key)) or entry[key] < 1:
                raise NumberError(
                    f"table '{name}': '{key}' must be an integer >= 1, got {entry.get(key)!r}"
                )
        features = _feature_names(entry, name)
        n = len(features)
        pooling = entry.get("pooling_factors", entry.get("pooling_factor"))
        pooling_factors = _per_feature(pooling, n, "pooling_factor", name)
        num_poolings = _per_feature(entry.get("num_poolings"), n, "num_poolings", name)
        batch_sizes = _per_feature(entry.get("batch_sizes"), n, "batch_sizes", name, integer=True)
        try:
            table = TableMeta(
                name=name,
                num_embeddings=entry["num_embeddings"],
                embedding_dim=entry["embedding_dim"],
                feature_names=features,
                pooling_factors=pooling_factors,
                num_poolings=num_poolings,
                batch_sizes=batch_sizes,
                data_type=entry.get("data_type", "FP32"),
                is_weighted=bool(entry.get("weighted", entry.get("is_weighted", False))),
                pooled=bool(entry.get("pooled", True)),
                module_fqn=str(entry.get("module", "")),
                optimizer=entry.get("optimizer", optimizer),
            )
        except ValueError as e:
            raise InputError(f"table '{name}': {e}") from e
        tables.append(table)
        if entry.get("constraints"):
            constraints[table.key] = _parse_constraints(name, entry["constraints"])
    return tables, constraints


def _parse_constraints(name: str, raw: Dict[str, Any]) -> ParameterConstraints:
    unknown = sorted(set(raw) - _CONSTRAINT_KEYS)
    if unknown:
        raise InputError(
            f"table '{name}': unknown constraint keys {unknown}; known: {sorted(_CONSTRAINT_KEYS)}"
        )
    raw = dict(raw)
    if raw.get("bounds_check_mode") is not None:
        raw["bounds_check_mode"] = BoundsCheckMode(str(raw["bounds_check_mode"]).lower())
    try:
        return ParameterConstraints(**raw)
    except (TypeError, ValueError) as e:
        raise InputError(f"table '{name}': bad constraints: {e}") from e
