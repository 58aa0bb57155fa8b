"""A managed collision module moved with `.to(device)` takes all its state along: its
buffers, and the history, default rows, lookup counts, evicted rows and id index it keeps
beside them (TorchRec's MCH module holds only buffers, so `.to()` moves everything). A
tensor left behind fails on a GPU at the first lookup ("indices should be either on cpu or
on the same device"); here the target is `meta`, which needs no GPU."""

from __future__ import annotations

import copy
from typing import Iterator, Tuple

import torch

from recshard.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from recshard.sparse import JaggedTensor


def tensors_held(
    obj: object, path: str = "", seen: set | None = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every tensor reachable from `obj` through attributes, lists and dicts of recshard and
    torch.nn objects."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensors_held(value, f"{path}[{key!r}]", seen)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensors_held(value, f"{path}[{i}]", seen)
    elif type(obj).__module__.startswith(("recshard", "torch.nn")) and hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            yield from tensors_held(value, f"{path}.{name}", seen)


def _trained() -> MCHManagedCollisionModule:
    """Several steps on the CPU: rows held, an eviction run, a history and counts pending."""
    module = MCHManagedCollisionModule(12, "cpu", LFU_EvictionPolicy(), 3, 10**6, buckets=2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, 40, (16,), generator=generator)
        module({"f": JaggedTensor(ids, lengths=torch.tensor([16]))})
    return module


def test_every_tensor_of_a_managed_collision_module_follows_to() -> None:
    module = _trained()
    assert len(module._history) > 0 and module._index.ids.numel() > 0  # state worth moving
    moved = copy.deepcopy(module).to("meta")
    left = [path for path, t in tensors_held(moved) if t.device.type != "meta"]
    assert not left, f"left on the CPU: {left}"
    assert moved.device.type == "meta"
    assert len(moved._history) == len(module._history)
    shapes = {name: t.shape for name, t in moved.state_dict().items()}
    assert shapes == {name: t.shape for name, t in module.state_dict().items()}
