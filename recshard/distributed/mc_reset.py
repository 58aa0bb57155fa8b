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

import functools
from typing import Dict, List, Tuple

import torch

from recshard.distributed import mc_library, mc_native_draw
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.modules.mc_embedding_modules import reset_rows

_GAMMA = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: torch's int64 ops wrap around
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
Shards = Dict[str, List[Tuple[LocalTable, torch.Tensor]]]
Configs = Dict[str, BaseEmbeddingConfig]


@functools.cache
def as_float32(value: float) -> float:
    """`value` rounded to float32 (cached: each table's init bounds, at every reset)."""
    return float(torch.tensor(value, dtype=torch.float32, device="cpu"))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """`z >> bits` as unsigned 64-bit numbers (torch's `>>` on int64 keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniform_draw(
    seed: int,
    config: BaseEmbeddingConfig,
    col_offset: int,
    target: torch.Tensor,
    rows: torch.Tensor,
) -> mc_native_draw.UniformDraw:
    """The default init's numbers for the columns `[col_offset, col_offset + cols)` of whole
    rows, drawn from `seed` in the order of `rows`, for `target[rows]` (`target [R, cols]`)."""
    assert config.weight_init_min is not None and config.weight_init_max is not None
    low = as_float32(config.weight_init_min)
    scale = as_float32(config.weight_init_max - config.weight_init_min)
    return mc_native_draw.UniformDraw(
        seed, config.embedding_dim, col_offset, low, scale, target, rows
    )


def draw_into(draw: mc_native_draw.UniformDraw) -> None:
    """`draw`'s numbers from torch ops, the same as `mc_native_draw.draw_uniform`'s (which defines
    them), written into `draw.out[draw.rows]` (any dtype and device)."""
    target, rows, dim, col_offset = draw.out, draw.rows, draw.dim, draw.col_offset
    cols, device = target.size(1), target.device
    position = torch.arange(rows.numel(), dtype=torch.int64, device=device).unsqueeze(1) * dim
    position = position + torch.arange(
        col_offset, col_offset + cols, dtype=torch.int64, device=device
    )
    z = ((position >> 1) + 1) * _GAMMA + draw.seed
    z = (z ^ _shift_right(z, 30)) * _M1
    z = (z ^ _shift_right(z, 27)) * _M2
    z = z ^ _shift_right(z, 31)
    drawn = torch.where(position & 1 == 1, (z >> 16) & 0xFFFFFF, _shift_right(z, 40))
    numbers = drawn.to(torch.float32).mul_(2.0**-24).mul_(draw.scale).add_(draw.low)
    target[rows] = numbers.to(target.dtype)


def _draw(tables: List[str], rows: List[torch.Tensor], weights: Shards, configs: Configs) -> None:
    """The default-init tables' draws (`rows`: each's local rows): one seed each, drawn in
    their order in one call (the numbers and generator state of a call per table), then every
    shard's numbers, those C++ draws in one call (`mc_native_draw.draw_uniform`)."""
    if not tables:
        return
    seeds = torch.randint(0, 2**62, (len(tables),), dtype=torch.int64, device="cpu").tolist()
    draws = [
        uniform_draw(seed, configs[table], local.col_offset, weight.data, ids.to(weight.device))
        for table, ids, seed in zip(tables, rows, seeds)
        for local, weight in weights[table]
    ]
    library = mc_library.enabled(torch.device("cpu"))
    native = [library and mc_native_draw.drawable(draw.out) for draw in draws]
    if any(native):
        mc_native_draw.draw_uniform([draw for draw, n in zip(draws, native) if n])
    for draw, n in zip(draws, native):
        if not n:
            draw_into(draw)


@torch.no_grad()
def reset_evicted(
    evictions: Dict[str, torch.Tensor | None],
    weights: Shards,
    states: Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]],
    configs: Configs,
) -> None:
    """Per table, the local rows given to new ids (`evictions`): weights re-drawn on each of
    this rank's shards (`weights`, written through `.data`), fused optimizer state (`states`)
    zeroed. The default init's seeds come from torch's generator in table order, around the
    draws of the tables with their own `init_fn`, as a seed per table would."""
    drawn: List[str] = []  # default-init tables whose seeds are not drawn yet
    drawn_rows: List[torch.Tensor] = []
    for table, rows in evictions.items():
        if rows is None or rows.numel() == 0:
            continue
        config = configs[table]
        shards = weights.get(table, [])
        if config.init_fn is None and shards:
            drawn.append(table)
            drawn_rows.append(rows)
        elif shards:
            _draw(drawn, drawn_rows, weights, configs)  # their seeds before init_fn's draws
            drawn, drawn_rows = [], []
            for local, weight in shards:
                reset_rows(weight, rows.to(weight.device), config, True, local.col_offset)
        for local, state in states.get(table, []):
            for tensor in state.values():
                if tensor.dim() >= 1 and tensor.size(0) == local.rows:
                    tensor[rows.to(tensor.device)] = 0
    _draw(drawn, drawn_rows, weights, configs)
