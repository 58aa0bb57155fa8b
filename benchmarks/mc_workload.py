"""The managed collision benchmark's workload in plain torch (no recshard, no torchrec), shared
by recshard's side (`benchmarks/mc.py`) and TorchRec's (`benchmarks/torchrec_mc.py.txt`):
26 one-feature tables of 64 columns, bags of 4 raw 64-bit ids, uniform or Zipf."""

from __future__ import annotations

import torch

TABLES, DIM, POOLING, WARMUP = 26, 64, 4, 3
LEARNING_RATE = 0.01


def raw_ids(gen: torch.Generator, n: int, zipf: bool) -> torch.Tensor:
    """`n` raw ids in [0, 2**62): uniform, or Zipf-like (~1/x over 1e6 ranks, scattered)."""
    if not zipf:
        return torch.randint(0, 2**62, (n,), generator=gen)
    rank = torch.rand(n, generator=gen).mul(-torch.log(torch.tensor(1e6))).exp()  # ~1/x
    return (1.0 / rank).long() * 2_654_435_761 % (2**62)


def batches(
    rank: int, batch: int, steps: int, zipf: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, lengths) of `steps + WARMUP` batches of `batch` bags per table for `rank`: keys
    `f0..f25` in order, lengths `[TABLES * batch]`."""
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.full((TABLES * batch,), POOLING)
    return [(raw_ids(gen, int(lengths.sum()), zipf), lengths) for _ in range(steps + WARMUP)]


def step_kinds(steps: int, interval: int) -> list[bool]:
    """Whether each timed step evicts: iteration k (1-based, warm-up included) evicts when
    k % interval == 0, in recshard and TorchRec alike."""
    return [(WARMUP + 1 + s) % interval == 0 for s in range(steps)]
