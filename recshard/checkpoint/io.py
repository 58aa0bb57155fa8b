"""Save and load sharded training state; load into any world size or plan.

Layout under `path`: one directory per save (`ckpt-<id>/`, written by
`torch.distributed.checkpoint`, each rank its own shards) and a `LATEST` file naming the
newest complete one. `LATEST` is replaced atomically after every rank has finished writing,
so a process killed mid-save leaves the previous checkpoint loadable. The previous directory
is kept until the next save completes.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from recshard.checkpoint.state import fused_optimizer_state, model_state_dict
from recshard.optim.keyed import CombinedOptimizer, KeyedOptimizer

LATEST = "LATEST"


def _unwrap(model: nn.Module) -> nn.Module:
    from recshard.distributed.model_parallel import get_unwrapped_module

    return get_unwrapped_module(model)


def _dense_optimizers(optimizer: Optional[KeyedOptimizer]) -> List[KeyedOptimizer]:
    """Dense (non-fused) keyed optimizers; their state is replicated, keyed by param FQN."""
    from recshard.optim.fused import FusedOptimizer

    if optimizer is None:
        return []
    if isinstance(optimizer, CombinedOptimizer):
        return [d for _, opt in optimizer.optimizers for d in _dense_optimizers(opt)]
    return [] if isinstance(optimizer, FusedOptimizer) else [optimizer]


def _training_state(model: nn.Module, optimizer: Optional[KeyedOptimizer]) -> Dict[str, Any]:
    module = _unwrap(model)
    state: Dict[str, Any] = {"model": model_state_dict(module)}
    if optimizer is not None:
        state["fused_optim"] = fused_optimizer_state(module)
        dense: Dict[str, torch.Tensor] = {}
        for opt in _dense_optimizers(optimizer):
            opt.init_state()
            for fqn, entry in opt.state_dict()["state"].items():
                dense.update({f"{fqn}.{name}": value for name, value in entry.items()
                              if isinstance(value, torch.Tensor)})
        state["dense_optim"] = dense
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _shared_name() -> str:
    name = [f"ckpt-{uuid.uuid4().hex[:12]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(path: str, model: nn.Module, optimizer: Optional[KeyedOptimizer] = None,
         extra: Optional[Dict[str, Any]] = None) -> str:
    """Write a checkpoint (collective: every rank calls it). Returns its directory."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    directory = root / _shared_name()
    dcp.save(_training_state(model, optimizer), checkpoint_id=str(directory))
    _barrier()
    if _rank() == 0:
        (directory / "extra.json").write_text(json.dumps(extra or {}))
        previous = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
        tmp = root / f"{LATEST}.tmp"
        tmp.write_text(directory.name)
        with open(tmp) as f:
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST)  # the commit point
        for stale in root.glob("ckpt-*"):
            if stale.name not in (directory.name, previous):
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return str(directory)


def latest_checkpoint(path: str) -> Path:
    root = Path(path)
    pointer = root / LATEST
    if not pointer.exists():
        raise FileNotFoundError(f"no complete checkpoint under {root} (no {LATEST} file)")
    directory = root / pointer.read_text().strip()
    if not (directory / ".metadata").exists():
        raise ValueError(f"checkpoint {directory} is incomplete or truncated (no .metadata)")
    return directory


def _check_shapes(template: Dict[str, Any], directory: Path) -> None:
    """Every key must exist in the checkpoint with the same global shape."""
    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    for section, entries in template.items():
        for key, value in entries.items():
            full_key = f"{section}.{key}"
            if full_key not in saved:
                raise ValueError(f"checkpoint {directory.name} has no '{key}' ({section})")
            saved_size = tuple(getattr(saved[full_key], "size", ()))
            size = tuple(value.size())
            if saved_size != size:
                raise ValueError(f"'{key}': checkpoint shape {saved_size} != model shape {size}")


def load(path: str, model: nn.Module, optimizer: Optional[KeyedOptimizer] = None) -> Dict[str, Any]:
    """Load the newest checkpoint under `path` into `model` (and `optimizer`), resharding to the
    model's current plan and world size. Returns the `extra` dict given to `save`."""
    directory = latest_checkpoint(path)
    template = _training_state(model, optimizer)
    _check_shapes(template, directory)
    dcp.load(template, checkpoint_id=str(directory))
    with torch.no_grad():  # DCP may replace plain tensors instead of copying into them
        live = _training_state(model, optimizer)
        for section, entries in template.items():
            for key, value in entries.items():
                target = live[section][key]
                if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards") \
                        and value.data_ptr() != target.data_ptr():
                    target.copy_(value)
    return json.loads((directory / "extra.json").read_text())
