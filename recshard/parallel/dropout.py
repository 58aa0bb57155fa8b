"""Dropout with the right randomness for tensor-parallel activations.

A sharded activation (each rank holds different features or sequence positions) needs an
independent mask per rank, or the ranks would drop the same positions of their shards.
A replicated activation needs the same mask on every rank, or the copies would diverge.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
from torch import Tensor, nn

from recshard.comm.pg import HoldsGroup
from recshard.parallel.utils import ProcessGroup, group_rank, group_size

_RANK_SEED_OFFSET = 2718  # sharded streams: seed + 2718 * (rank + 1), never the shared seed


def _shared_seed(pg: ProcessGroup | None) -> int:
    """A seed drawn from the default generator on the group's first rank, sent to all."""
    seed = [int(torch.randint(0, 2**31 - 1, (1,), device="cpu").item())]
    if group_size(pg) > 1:
        src = dist.get_global_rank(pg, 0) if pg is not None else 0
        dist.broadcast_object_list(seed, src=src, group=pg)
    return seed[0]


class ParallelDropout(HoldsGroup, nn.Module):
    """Dropout for tensor-parallel activations. x [*] -> x [*] (zeroed with prob `p`,
    survivors scaled by 1 / (1 - p), in training mode only).

    `input_is_parallel=True`: x is sharded, each rank draws its own mask (its generator is
    seeded with `seed + 2718 * (rank + 1)`). False: x is replicated, every rank draws the same
    mask (generator seeded with `seed`). `seed=None` draws one seed from the default
    generator and broadcasts it from the group's first rank (so construction is a collective).
    The layer's generators are its own: the global RNG stream is not consumed by forward.
    """

    def __init__(
        self,
        p: float = 0.5,
        input_is_parallel: bool = True,
        seed: int | None = None,
        pg: ProcessGroup | None = None,
        inplace: bool = False,
    ) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"ParallelDropout: p must be in [0, 1], got {p}")
        self.p, self.input_is_parallel, self.inplace, self.pg = p, input_is_parallel, inplace, pg
        self.seed = _shared_seed(pg) if seed is None else int(seed)
        rank = group_rank(pg)
        offset = _RANK_SEED_OFFSET * (rank + 1) if input_is_parallel else 0
        self.stream_seed = (self.seed + offset) % 2**63
        self._generators: Dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.stream_seed)
            self._generators[device] = gen
        return self._generators[device]

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x.mul_(0.0) if self.inplace else x * 0.0
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self._generator(x.device))
        keep.div_(1.0 - self.p)
        return x.mul_(keep) if self.inplace else x * keep

    def extra_repr(self) -> str:
        return f"p={self.p}, input_is_parallel={self.input_is_parallel}, seed={self.seed}"
