"""`Hooks`: the copies a caller of the shared-memory all-to-all (`recshard.comm.shm`) makes
itself, so that a part moves straight between the caller's tensors and shared memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["NO_HOOKS", "Hooks"]


@dataclass(frozen=True)
class Hooks:
    """Copies a caller makes itself, so that a part goes straight between its own tensors and
    shared memory instead of through the flat `wire` and `out` buffers.

    `skip_self`: this rank's part is not copied from `wire` into `out` (the caller has its own
    part where it needs it). `place(peer, part)`: takes a peer's whole part (its bytes, in the
    peer's segment) where it arrives in one piece, instead of the copy into `out`; a part that
    streams through in pieces still lands in `out`. `fill(peer, part)`: writes this rank's
    part for `peer` into `part` (bytes): into the ring where it fits whole, else into `wire`
    before the first piece goes (`wire` need not hold the peers' parts then).
    """

    skip_self: bool = False
    place: Callable[[int, torch.Tensor], None] | None = None
    fill: Callable[[int, torch.Tensor], None] | None = None


NO_HOOKS = Hooks()
