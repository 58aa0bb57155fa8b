"""Fake (shape-only) twins of the fbgemm script objects a quantized TBE holds, so that
`torch.export` can trace a model with a `QuantEmbeddingBagCollection` / `QuantEmbeddingCollection`.

fbgemm's inference TBE keeps `fbgemm::AtomicCounter`s (cache timesteps); export replaces script
objects by fakes and needs a registered class that mimics their methods on plain ints; the
`fbgemm::TensorQueue`s (prefetch queues) likewise on a Python list.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

_registered = False


class FakeAtomicCounter:
    """`fbgemm::AtomicCounter` on a Python int."""

    def __init__(self, counter_: int) -> None:
        self.counter_ = counter_

    @classmethod
    def __obj_unflatten__(cls, flat_obj: List[Tuple[str, Any]]) -> FakeAtomicCounter:
        return cls(**dict(flat_obj))

    def increment(self) -> int:
        self.counter_ += 1
        return self.counter_

    def decrement(self) -> int:
        self.counter_ -= 1
        return self.counter_

    def reset(self) -> None:
        self.counter_ = 0

    def get(self) -> int:
        return self.counter_

    def set(self, val: int) -> None:
        self.counter_ = val


class FakeTensorQueue:
    """`fbgemm::TensorQueue` on a Python list; `init_tensor` is what an empty queue yields."""

    def __init__(self, queue: List[torch.Tensor], init_tensor: torch.Tensor) -> None:
        self.queue = queue
        self.init_tensor = init_tensor

    @classmethod
    def __obj_unflatten__(cls, flat_obj: List[Tuple[str, Any]]) -> FakeTensorQueue:
        return cls(**dict(flat_obj))

    def push(self, x: torch.Tensor) -> None:
        self.queue.append(x)

    def pop(self) -> torch.Tensor:
        return self.queue.pop(0) if self.queue else self.init_tensor

    def top(self) -> torch.Tensor:
        return self.queue[0] if self.queue else self.init_tensor

    def size(self) -> int:
        return len(self.queue)


def register_fake_classes() -> None:
    """Register the fakes once (call after fbgemm is loaded; a no-op after the first call)."""
    global _registered
    if not _registered:
        torch._library.register_fake_class("fbgemm::AtomicCounter")(FakeAtomicCounter)
        torch._library.register_fake_class("fbgemm::TensorQueue")(FakeTensorQueue)
        _registered = True
