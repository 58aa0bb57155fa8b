"""Big per-step buffers (collective receive buffers, reordered outputs) reused across steps.

Every training step needs the same large buffers again: the pooled all-to-all receives
`[B, D]` both ways, the KJT all-to-all receives the ids. Fresh ones each step come from glibc,
which for blocks this size often means mmap, then a page fault and zeroing per 4 KiB on first
touch and munmap on free: on CPU that costs as much as the copies themselves. `take` hands
back a buffer of an earlier step once nothing else holds its memory (no tensor, view or
detached alias of it is left, checked on the storage's use count), else a new one.

A buffer's contents are unspecified (like `torch.empty`). Kept per process: a few buffers per
call site, about one step's receive buffers in all.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

import torch

_PER_SITE = 4  # buffers kept per (site, dtype, device): concurrent batches, several shardings
_MIN_BYTES = 1 << 20  # smaller blocks come from the allocator's free lists anyway
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _Slot:
    """A kept buffer and its storage's use count when only the pool holds it."""

    __slots__ = ("tensor", "storage", "idle_count")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.storage = tensor.untyped_storage()
        self.idle_count = _storage_use_count(self.storage._cdata)

    def idle(self) -> bool:
        return _storage_use_count(self.storage._cdata) == self.idle_count


_slots: Dict[Tuple[str, torch.dtype, torch.device], List[_Slot]] = {}
_lock = threading.Lock()


def take(site: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer of `numel` elements for call site `site` (e.g. a collective's name): a
    new tensor on the memory of an idle kept buffer, or on new memory."""
    device = torch.device(device)
    size = dtype.itemsize * numel
    if _storage_use_count is None or device.type != "cpu" or size < _MIN_BYTES:
        return torch.empty(numel, dtype=dtype, device=device)
    key = (site, dtype, device)
    with _lock:
        slots = _slots.setdefault(key, [])
        found: _Slot | None = next(
            (s for s in slots if numel <= s.tensor.numel() <= 2 * numel and s.idle()), None
        )
        if found is None:
            found = _Slot(torch.empty(numel, dtype=dtype, device=device))
            slots.append(found)
            if len(slots) > _PER_SITE:
                slots.pop(0)
        # a plain tensor on the kept storage, not a view: callers may modify it in place
        return torch.empty(0, dtype=dtype, device=device).set_(found.storage, 0, (numel,), (1,))


def kept() -> List[Tuple[str, int]]:
    """(site, elements) of every buffer kept now."""
    with _lock:
        return [(key[0], slot.tensor.numel()) for key, slots in _slots.items() for slot in slots]


def clear() -> None:
    """Drop every kept buffer (their memory returns once no step uses them)."""
    with _lock:
        _slots.clear()
