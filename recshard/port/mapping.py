"""Which recshard module provides a name that a TorchRec module provides.

`MODULE_MAP` maps TorchRec module paths to the recshard module holding the same public names.
A name is mapped only if that recshard module really provides it (checked by importing it),
so the table cannot promise more than recshard has; anything else comes back with a reason.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, Sequence, Tuple

MODULE_MAP: Dict[str, str] = {
    "torchrec": "recshard",
    "torchrec.sparse": "recshard.sparse",
    "torchrec.sparse.jagged_tensor": "recshard.sparse",
    "torchrec.sparse.jagged_tensor_validator": "recshard.sparse.validation",
    "torchrec.modules": "recshard.modules",
    "torchrec.modules.embedding_configs": "recshard.modules",
    "torchrec.modules.embedding_modules": "recshard.modules",
    "torchrec.modules.mlp": "recshard.modules.mlp",
    "torchrec.modules.crossnet": "recshard.modules.crossnet",
    "torchrec.modules.regroup": "recshard.modules.regroup",
    "torchrec.modules.mc_modules": "recshard.modules.mc_modules",
    "torchrec.modules.mc_embedding_modules": "recshard.modules.mc_embedding_modules",
    "torchrec.models": "recshard.models",
    "torchrec.models.dlrm": "recshard.models.dlrm",
    "torchrec.datasets": "recshard.datasets",
    "torchrec.datasets.random": "recshard.datasets.random",
    "torchrec.datasets.criteo": "recshard.datasets.criteo",
    "torchrec.datasets.utils": "recshard.datasets.utils",
    "torchrec.streamable": "recshard.types",
    "torchrec.types": "recshard",
    "torchrec.fx": "recshard.fx",
    "torchrec.fx.tracer": "recshard.fx",
    "torchrec.distributed": "recshard.distributed",
    "torchrec.distributed.model_parallel": "recshard.distributed",
    "torchrec.distributed.embeddingbag": "recshard.distributed",
    "torchrec.distributed.embedding": "recshard.distributed",
    "torchrec.distributed.quant_embeddingbag": "recshard.distributed",
    "torchrec.distributed.mc_modules": "recshard.distributed.mc_modules",
    "torchrec.distributed.mc_embeddingbag": "recshard.distributed.mc_embeddingbag",
    "torchrec.distributed.mc_embedding": "recshard.distributed.mc_embedding",
    "torchrec.distributed.mc_embedding_modules": "recshard.distributed.mc_embedding_modules",
    "torchrec.distributed.train_pipeline": "recshard.distributed",
    "torchrec.distributed.train_pipeline.train_pipelines": "recshard.distributed",
    "torchrec.distributed.sharding_plan": "recshard.distributed.sharding_plan",
    "torchrec.distributed.types": "recshard.types",
    "torchrec.distributed.embedding_types": "recshard.types",
    "torchrec.distributed.planner": "recshard.planner",
    "torchrec.distributed.planner.planners": "recshard.planner",
    "torchrec.distributed.planner.types": "recshard.planner",
    "torchrec.distributed.planner.storage_reservations": "recshard.planner",
    "torchrec.distributed.fbgemm_qcomm_codec": "recshard.comm",
    "torchrec.distributed.dist_data": "recshard.comm",
    "torchrec.distributed.comm_ops": "recshard.comm",
    "torchrec.optim": "recshard.optim",
    "torchrec.optim.keyed": "recshard.optim",
    "torchrec.optim.optimizers": "recshard.optim",
    "torchrec.optim.rowwise_adagrad": "recshard.optim",
    "torchrec.optim.fused": "recshard.optim",
    "torchrec.optim.warmup": "recshard.optim",
    "torchrec.optim.clipping": "recshard.optim",
    "torchrec.quant": "recshard.quant",
    "torchrec.quant.embedding_modules": "recshard.quant",
    "torchrec.inference.modules": "recshard.quant",
}


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


def resolve_module(torchrec_module: str) -> str:
    """The recshard module for a TorchRec module path, or `Unmapped` with the reason."""
    if torchrec_module not in MODULE_MAP:
        raise Unmapped(f"recshard has no counterpart of module {torchrec_module}")
    return MODULE_MAP[torchrec_module]


def resolve_name(torchrec_module: str, name: str) -> Resolved:
    """Where `from <torchrec_module> import <name>` finds `name` in recshard."""
    submodule = f"{torchrec_module}.{name}"
    if submodule in MODULE_MAP:
        target = MODULE_MAP[submodule]
        parent, _, leaf = target.rpartition(".")
        return Resolved(parent, leaf) if parent else Resolved(target, None)
    module = resolve_module(torchrec_module)
    if not provides(module, name):
        raise Unmapped(f"{module} has no {name} (TorchRec's {torchrec_module}.{name})")
    return Resolved(module, name)


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
    raise Unmapped(f"recshard has no counterpart of module {'.'.join(parts)}")
