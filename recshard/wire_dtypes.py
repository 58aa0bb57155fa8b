"""Integers on the wire in the fewest bytes that hold them: the dtype rule the KJT all-to-all
sends ids and lengths by (`recshard.comm.wire`) and the planner prices its bytes by, in one
place below both.

The ids of a key whose table has `rows` rows lie in `[0, rows)` once the input dist has
bounds-checked them, so they travel as uint8 (rows <= 2**8), uint16 (<= 2**16), int32
(<= 2**31) or, beyond, int64.
"""

from __future__ import annotations

import torch

WIRE_DTYPES = (torch.uint8, torch.uint16, torch.int32, torch.int64)


def narrowest(low: int, high: int) -> torch.dtype:
    """The first of `WIRE_DTYPES` that holds every integer in `[low, high]`."""
    for dtype in WIRE_DTYPES:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    raise ValueError(f"integers in [{low}, {high}] do not fit int64")


def id_wire_dtype(rows: int | None, dtype: torch.dtype) -> torch.dtype:
    """What the ids of a `rows`-row table (`[0, rows)`, checked; None: unchecked, any value)
    travel as when they are `dtype`: the narrower of the two."""
    if rows is None:
        return dtype
    wire = narrowest(0, max(rows - 1, 0))
    return wire if wire.itemsize < dtype.itemsize else dtype
