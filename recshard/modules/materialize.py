"""Materialize a module built on `meta`: real storage for its `meta` tensors, then their
initial values from `reset_parameters()`.

The module that initializes a tensor is not always the one that holds it: a
`PositionWeightedModuleCollection` keeps its weights in an `nn.ParameterDict` child, which has
no `reset_parameters`; its owner's fills them. So each holder is reset by the nearest module,
itself or an ancestor, that has `reset_parameters`. `to_empty` leaves whatever the memory held,
so a `meta` tensor that no module can initialize is an error, not left to chance.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
from torch import nn


def materialize(
    module: nn.Module, device: torch.device, skip: Callable[[nn.Module], bool] = lambda _: False
) -> None:
    """Give every `meta` parameter and buffer under `module` storage on `device` and its initial
    value. Modules for which `skip` holds keep their own tensors (their children are still
    visited) and initialize none of their descendants."""
    owners: Dict[int, nn.Module] = {}
    order: List[nn.Module] = []

    def visit(child: nn.Module, path: str, owner: nn.Module | None) -> None:
        skipped = skip(child)
        if not skipped and hasattr(child, "reset_parameters"):
            owner = child
        elif skipped:
            owner = None
        own = list(child.named_parameters(recurse=False)) + list(child.named_buffers(recurse=False))
        meta = [name for name, t in own if t.is_meta]
        if meta and not skipped:
            if owner is None:
                raise ValueError(
                    f"'{_join(path, meta[0])}' is on meta and neither its module nor any module "
                    "above it has reset_parameters() to initialize it"
                )
            child.to_empty(device=device, recurse=False)
            if id(owner) not in owners:
                owners[id(owner)] = owner
                order.append(owner)
        for name, grandchild in child.named_children():
            visit(grandchild, _join(path, name), owner)

    visit(module, "", None)
    for owner in order:
        owner.reset_parameters()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
