"""The JSON form of TorchRec's `CacheParams` (plan files, constraints files): its plain
fields by name, enum members by name or value; `stats` and the prefetch config stay Python
objects."""

from __future__ import annotations

from typing import Any, Dict

from recshard.modules.embedding_configs import DataType
from recshard.types import CacheAlgorithm, CacheParams

_CACHE_FIELDS = ("algorithm", "load_factor", "reserved_memory", "precision", "prefetch_pipeline")


def cache_params_from_dict(raw: Dict[str, Any]) -> CacheParams:
    """A `CacheParams` from its JSON form: `algorithm` ("LRU" / "LFU"), `load_factor` and
    `reserved_memory` (numbers), `precision` (a `DataType` name), `prefetch_pipeline`; enum
    members are taken as they are. `stats` and the fbgemm prefetch config are objects, not
    JSON: pass a `CacheParams` for them. ValueError names the bad key and value."""
    unknown = sorted(set(raw) - set(_CACHE_FIELDS))
    if unknown:
        raise ValueError(
            f"cache_params: unknown keys {unknown}; known: {list(_CACHE_FIELDS)} "
            "(stats: pass a CacheParams with a CacheStatistics from Python)"
        )
    values = dict(raw)
    try:
        if isinstance(values.get("algorithm"), str):
            values["algorithm"] = CacheAlgorithm[values["algorithm"].upper()]
        if isinstance(values.get("precision"), str):
            values["precision"] = DataType(values["precision"].upper())
    except (KeyError, ValueError):
        raise ValueError(
            f"cache_params: bad algorithm / precision in {raw}; algorithm is one "
            f"of {[a.name for a in CacheAlgorithm]}, precision one of "
            f"{[d.value for d in DataType]}"
        ) from None
    for key in ("load_factor", "reserved_memory"):
        value = values.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value
        ):
            raise ValueError(f"cache_params: {key} must be a number >= 0, got {value!r}")
    return CacheParams(**values)


def cache_params_to_dict(params: CacheParams | None) -> Dict[str, Any] | None:
    """The JSON form of `params` (see `cache_params_from_dict`): the set fields other than
    `stats` and the prefetch config, which are objects (TorchRec's hash leaves `stats` out
    too); None for None."""
    if params is None:
        return None
    out: Dict[str, Any] = {}
    for key in _CACHE_FIELDS:
        value = getattr(params, key)
        if value is not None:
            out[key] = value.name if key == "algorithm" else getattr(value, "value", value)
    return out
