"""Integers on the wire in the fewest bytes that hold them (the KJT all-to-all's format).

The ids of a key whose table has `rows` rows lie in `[0, rows)` once the input dist has
bounds-checked them, so they travel as uint8 (rows <= 2**8), uint16 (<= 2**16), int32
(<= 2**31) or, beyond, int64 (`id_wire_dtype`); lengths travel in the narrowest type that holds
every rank's lengths (`narrowest`). The receiver casts back to the sender's dtype: the numbers
are the same, only the bytes on the wire differ (a 100 k-row table's int64 ids take half).

`pack` lays out segments of a 1-D tensor (one key's ids, one key's weights), each in its own
dtype, in one uint8 buffer; every segment is padded to 8 bytes so the receiver can view it in
its dtype in place. `unpack` reads such a buffer back, segments in any order.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from recshard.comm import buffers

WIRE_DTYPES = (torch.uint8, torch.uint16, torch.int32, torch.int64)
_ALIGN = 8  # bytes; the widest wire element


def narrowest(low: int, high: int) -> torch.dtype:
    """The first of `WIRE_DTYPES` that holds every integer in `[low, high]`."""
    for dtype in WIRE_DTYPES:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    raise ValueError(f"integers in [{low}, {high}] do not fit int64")


def id_wire_dtype(rows: Optional[int], dtype: torch.dtype) -> torch.dtype:
    """What the ids of a `rows`-row table (`[0, rows)`, checked; None: unchecked, any value)
    travel as when they are `dtype`: the narrower of the two."""
    if rows is None:
        return dtype
    wire = narrowest(0, max(rows - 1, 0))
    return wire if wire.itemsize < dtype.itemsize else dtype


def segment_bytes(count: int, dtype: torch.dtype) -> int:
    """Bytes one segment of `count` elements of `dtype` takes in a packed buffer (padded)."""
    return -(-count * dtype.itemsize // _ALIGN) * _ALIGN


def pack(
    x: torch.Tensor, counts: Sequence[int], dtypes: Sequence[torch.dtype], site: str,
    starts: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """`x[1-D]`, cut into segments of `counts` elements (back to back, or beginning at
    `starts`, in any order, repeats allowed), each cast to its dtype: a uint8 buffer (reused
    per `site`, see `comm/buffers.py`) of `sum(segment_bytes)` bytes."""
    sizes = [segment_bytes(n, d) for n, d in zip(counts, dtypes)]
    if starts is None:
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
    out = buffers.take(site, sum(sizes), torch.uint8, x.device)
    offset = 0
    for start, count, dtype, size in zip(starts, counts, dtypes, sizes):
        if count:
            out[offset: offset + count * dtype.itemsize].view(dtype).copy_(x[start: start + count])
        offset += size
    return out


def unpack(
    wire: torch.Tensor,
    counts: Sequence[int],
    dtypes: Sequence[torch.dtype],
    dtype: torch.dtype,
    order: Optional[List[int]],
    site: str,
) -> torch.Tensor:
    """A packed buffer's segments (`counts`, `dtypes` in buffer order) cast to `dtype` and
    concatenated in `order` (segment indices; None: buffer order): `[sum(counts)]`."""
    sizes = [segment_bytes(n, d) for n, d in zip(counts, dtypes)]
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + size)
    out = buffers.take(site, sum(counts), dtype, wire.device)
    start = 0
    for i in range(len(counts)) if order is None else order:
        count, segment_dtype = counts[i], dtypes[i]
        if count:
            raw = wire[offsets[i]: offsets[i] + count * segment_dtype.itemsize]
            out[start: start + count].copy_(raw.view(segment_dtype))
        start += count
    return out
