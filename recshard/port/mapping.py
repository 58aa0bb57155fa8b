"""Which recshard module provides a name that a TorchRec module provides.

The table is `recshard.port.torchrec_paths` (`MODULE_MAP`, `ALSO_SEARCHED`, `NOT_PROVIDED`).
A name is mapped only if a recshard module really provides it (checked by importing it),
so the table cannot promise more than recshard has; anything else comes back with a reason:
the one `NOT_PROVIDED` gives, or that recshard lacks it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, Sequence, Tuple, TypeVar

from recshard.port.torchrec_paths import ALSO_SEARCHED, MODULE_MAP, NOT_PROVIDED

__all__ = [
    "MODULE_MAP",
    "Resolved",
    "Unmapped",
    "not_provided_reason",
    "provides",
    "resolve_chain",
    "resolve_name",
    "unmapped_module_reason",
]


_V = TypeVar("_V")


@dataclass(frozen=True)
class Resolved:
    """Where a TorchRec name lives in recshard: `module` and, for an attribute, `name`
    (None when the TorchRec path is itself a module)."""

    module: str
    name: str | None

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


class Unmapped(Exception):
    """A TorchRec name recshard does not provide; `str()` is the reason."""


def _load(module: str) -> ModuleType:
    return importlib.import_module(module)


def _is_submodule(module: str, name: str) -> bool:
    if not hasattr(_load(module), "__path__"):
        return False
    return importlib.util.find_spec(f"{module}.{name}") is not None


def provides(module: str, name: str) -> bool:
    """True if recshard `module` has the public name `name`: in its `__all__`, else defined
    by recshard (a class or function of recshard, or a plain constant), or a submodule —
    never something it merely imported, such as `torch` or `typing.List`."""
    if name.startswith("_"):
        return False
    loaded = _load(module)
    exported = getattr(loaded, "__all__", None)
    if exported is not None and name in exported:
        return True
    if exported is None and hasattr(loaded, name):
        value = getattr(loaded, name)
        owner = getattr(value, "__module__", None)
        if not isinstance(value, ModuleType) and (owner is None or owner.startswith("recshard")):
            return True
    return _is_submodule(module, name)


def _longest_prefix(path: str, table: Dict[str, _V]) -> _V | None:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in table:
            return table[prefix]
    return None


def not_provided_reason(path: str) -> str | None:
    """Why recshard deliberately lacks TorchRec's `path` (a module or `module.name`), or None."""
    reason = _longest_prefix(path, NOT_PROVIDED)
    return None if reason is None else f"not provided: {reason}"


def unmapped_module_reason(torchrec_module: str) -> str:
    """Why a TorchRec module path has no recshard counterpart."""
    return not_provided_reason(torchrec_module) or (
        f"recshard has no counterpart of module {torchrec_module}"
    )


def resolve_module(torchrec_module: str) -> str:
    """The recshard module for a TorchRec module path, or `Unmapped` with the reason."""
    if torchrec_module not in MODULE_MAP:
        raise Unmapped(unmapped_module_reason(torchrec_module))
    return MODULE_MAP[torchrec_module]


def resolve_name(torchrec_module: str, name: str) -> Resolved:
    """Where `from <torchrec_module> import <name>` finds `name` in recshard."""
    submodule = f"{torchrec_module}.{name}"
    if submodule in MODULE_MAP:
        target = MODULE_MAP[submodule]
        parent, _, leaf = target.rpartition(".")
        return Resolved(parent, leaf) if parent else Resolved(target, None)
    module = resolve_module(torchrec_module)
    reason = NOT_PROVIDED.get(f"{torchrec_module}.{name}")
    if reason is not None:
        raise Unmapped(f"not provided: {reason}")
    for candidate in (module, *(_longest_prefix(torchrec_module, ALSO_SEARCHED) or ())):
        if provides(candidate, name):
            return Resolved(candidate, name)
    raise Unmapped(f"{module} has no {name} (TorchRec's {torchrec_module}.{name})")


def resolve_chain(parts: Sequence[str]) -> Tuple[Resolved, int]:
    """An attribute chain such as `torchrec.distributed.DistributedModelParallel.method`:
    its longest module prefix in `MODULE_MAP` and the one name after it. Returns where that
    lives in recshard and how many leading parts it replaces (the rest stay attributes)."""
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix not in MODULE_MAP:
            continue
        if cut == len(parts):
            return Resolved(MODULE_MAP[prefix], None), cut
        return resolve_name(prefix, parts[cut]), cut + 1
    raise Unmapped(unmapped_module_reason(".".join(parts)))
