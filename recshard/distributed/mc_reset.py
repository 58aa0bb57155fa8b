"""The reset of the rows a sharded managed collision collection gave to new ids: their weights
re-drawn by the table's init, their fused optimizer state zeroed, on every shard of the table.

A table with its own `init_fn` gets it, called on the block of its rows (TorchRec's way,
`recshard.modules.mc_embedding_modules.reset_rows`). A table with the default init (uniform in
`[weight_init_min, weight_init_max]`) gets its numbers from a counter-based generator
(splitmix64 of each number's position in the block of whole rows), seeded once per table and
reset from torch's default generator, so `torch.manual_seed` still fixes them: on the CPU in
C++ (`rs_mc_draw_uniform`, a column shard draws its columns only), elsewhere or without the
library from torch ops, the same numbers (`draw_into`). Why: torch's `uniform_` draws about
3 ns a number on one thread, so a first fill (every row of 26 tables of 5,000 x 64 given out at
one eviction) spent ~40 ms drawing; the C++ generator draws them in a fraction of that.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from recshard.distributed import mc_native
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.modules.mc_embedding_modules import reset_rows

_GAMMA = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: torch's int64 ops wrap around
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
Shards = Dict[str, List[Tuple[LocalTable, torch.Tensor]]]


def as_float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32, device="cpu"))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """`z >> bits` as unsigned 64-bit numbers (torch's `>>` on int64 keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def draw_into(
    seed: int,
    config: BaseEmbeddingConfig,
    col_offset: int,
    target: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """The default init's numbers for the columns `[col_offset, col_offset + cols)` of whole
    rows, drawn from `seed` in the order of `rows` and written into `target[rows]` (`target
    [R, cols]`): in C++ straight into float32 CPU rows (`rs_mc_draw_uniform` defines the
    numbers), else the same numbers from torch ops."""
    assert config.weight_init_min is not None and config.weight_init_max is not None
    low = as_float32(config.weight_init_min)
    scale = as_float32(config.weight_init_max - config.weight_init_min)
    dim, cols = config.embedding_dim, target.size(1)
    native = mc_native.enabled(target.device) and target.dtype == torch.float32
    if native and target.stride(1) == 1 and target.stride(0) >= cols:
        mc_native.draw_uniform(seed, dim, col_offset, low, scale, target, rows)
        return
    device = target.device
    position = torch.arange(rows.numel(), dtype=torch.int64, device=device).unsqueeze(1) * dim
    position = position + torch.arange(
        col_offset, col_offset + cols, dtype=torch.int64, device=device
    )
    z = ((position >> 1) + 1) * _GAMMA + seed
    z = (z ^ _shift_right(z, 30)) * _M1
    z = (z ^ _shift_right(z, 27)) * _M2
    z = z ^ _shift_right(z, 31)
    drawn = torch.where(position & 1 == 1, (z >> 16) & 0xFFFFFF, _shift_right(z, 40))
    numbers = drawn.to(torch.float32).mul_(2.0**-24).mul_(scale).add_(low)
    target[rows] = numbers.to(target.dtype)


@torch.no_grad()
def reset_evicted(
    evictions: Dict[str, torch.Tensor | None],
    weights: Shards,
    states: Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]],
    configs: Dict[str, BaseEmbeddingConfig],
) -> None:
    """Per table, the local rows given to new ids (`evictions`): weights re-drawn on each of
    this rank's shards (`weights`, written through `.data`), fused optimizer state (`states`)
    zeroed."""
    for table, rows in evictions.items():
        if rows is None or rows.numel() == 0:
            continue
        config = configs[table]
        seed = None
        for local, weight in weights.get(table, []):
            rows_here = rows.to(weight.device)
            if config.init_fn is not None:
                reset_rows(weight, rows_here, config, True, local.col_offset)
                continue
            if seed is None:  # one per table and reset: its shards draw from one block
                seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu"))
            draw_into(seed, config, local.col_offset, weight.data, rows_here)
        for local, state in states.get(table, []):
            for tensor in state.values():
                if tensor.dim() >= 1 and tensor.size(0) == local.rows:
                    tensor[rows.to(tensor.device)] = 0
