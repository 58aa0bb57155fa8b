"""A managed collision reset's default-init numbers in C++ (`csrc/mc_draw.cpp`): every shard's
draw of a reset in one call, written straight into the tables' rows (`draw_uniform`; the
numbers and the torch ops giving the same: `recshard.distributed.mc_reset`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from recshard.distributed import mc_library


@dataclass
class UniformDraw:
    """The default init's numbers of one shard's reset (`recshard.distributed.mc_reset`),
    drawn from `seed` for the columns `[col_offset, col_offset + out.size(1))` of whole rows of
    `dim` columns, written straight into `out[rows]` (`out [R, cols]` float32, rows contiguous;
    `rows [N]` in `[0, R)`, the order of the draws); `low` and `scale` are float32 values."""

    seed: int
    dim: int
    col_offset: int
    low: float
    scale: float
    out: torch.Tensor
    rows: torch.Tensor


def drawable(out: torch.Tensor) -> bool:
    """Whether `draw_uniform` writes into `out`: a float32 CPU matrix of contiguous rows."""
    return (
        out.dtype == torch.float32
        and out.dim() == 2
        and out.device.type == "cpu"
        and out.stride(1) == 1
        and out.stride(0) >= out.size(1)
    )


def draw_uniform(draws: Sequence[UniformDraw]) -> None:
    """Every draw's numbers in one C++ call (`rs_mc_draw_uniform`: all checked before any is
    written)."""
    columns, bounds, kept = [], [], []  # kept: the contiguous rows, alive through the call
    for draw in draws:
        out, rows = draw.out, draw.rows.contiguous()
        kept.append(rows)
        if not drawable(out):
            raise ValueError(
                "reset rows must be a float32 CPU matrix of contiguous rows, got "
                f"{out.dtype} {out.device} strides {out.stride()}"
            )
        address = mc_library.vector("reset rows", rows)
        columns.append(
            (draw.seed, rows.numel(), address, draw.dim, draw.col_offset,
             out.size(1), out.size(0), out.stride(0), out.data_ptr())
        )  # fmt: skip
        bounds.append((draw.low, draw.scale))
    arguments, at = mc_library.argument_arrays(columns, 9, torch.int64)
    floats, (low_at, scale_at) = mc_library.argument_arrays(bounds, 2, torch.float32)
    code = mc_library.library().rs_mc_draw_uniform(len(columns), *at[:6], low_at, scale_at, *at[6:])
    mc_library.check(code, "reset draw")
