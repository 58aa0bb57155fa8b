"""Integers on the wire in the fewest bytes that hold them (the KJT all-to-all's format).

The ids of a key whose table has `rows` rows lie in `[0, rows)` once the input dist has
bounds-checked them, so they travel as uint8 (rows <= 2**8), uint16 (<= 2**16), int32
(<= 2**31) or, beyond, int64 (`id_wire_dtype`, in `recshard.wire_dtypes`, which the planner
prices by too); a sender's lengths travel in the narrowest type
that holds them (`narrowest`), in the same buffer as its ids. The receiver casts back to the
sender's dtype: the numbers are the same, only the bytes on the wire differ (a 100 k-row
table's int64 ids take half).

`pack` lays out segments of 1-D tensors (a destination's lengths, one key's ids, one key's
weights), each in its own dtype, in one uint8 buffer; every segment is padded to 8 bytes so the
receiver can view it in its dtype in place. `unpack` reads such a buffer back, any of its
segments in any order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from recshard.comm import buffers
from recshard.wire_dtypes import id_wire_dtype, narrowest  # noqa: F401 - id_wire_dtype re-exported

_ALIGN = 8  # bytes; the widest wire element


def lengths_wire_dtype(low: int, high: int, dtype: torch.dtype) -> torch.dtype:
    """What lengths in `[low, high]` travel as when they are `dtype`: the narrower of the
    narrowest type that holds them and `dtype` (the receiver, told the range, works it out)."""
    wire = narrowest(low, high)
    return wire if wire.itemsize < dtype.itemsize else dtype


def segment_bytes(count: int, dtype: torch.dtype) -> int:
    """Bytes one segment of `count` elements of `dtype` takes in a packed buffer (padded)."""
    return -(-count * dtype.itemsize // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Segment:
    """`count` elements of a 1-D tensor from `start`, sent as `dtype`."""

    source: torch.Tensor
    start: int
    count: int
    dtype: torch.dtype


def pack_segments(segments: Sequence[Segment], site: str) -> torch.Tensor:
    """The segments, each cast to its dtype and padded (`segment_bytes`), back to back: a uint8
    buffer reused per `site` (see `comm/buffers.py`)."""
    sizes = [segment_bytes(s.count, s.dtype) for s in segments]
    device = segments[0].source.device if segments else torch.device("cpu")
    out = buffers.take(site, sum(sizes), torch.uint8, device)
    offset = 0
    for s, size in zip(segments, sizes):
        if s.count:
            out[offset : offset + s.count * s.dtype.itemsize].view(s.dtype).copy_(
                s.source[s.start : s.start + s.count]
            )
        offset += size
    return out


def pack(
    x: torch.Tensor,
    counts: Sequence[int],
    dtypes: Sequence[torch.dtype],
    site: str,
    starts: Sequence[int] | None = None,
) -> torch.Tensor:
    """`x[1-D]`, cut into segments of `counts` elements (back to back, or beginning at
    `starts`, in any order, repeats allowed), each cast to its dtype (`pack_segments`)."""
    if starts is None:
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
    return pack_segments(
        [Segment(x, start, count, dtype) for start, count, dtype in zip(starts, counts, dtypes)],
        site,
    )


def unpack(
    wire: torch.Tensor,
    counts: Sequence[int],
    dtypes: Sequence[torch.dtype],
    dtype: torch.dtype,
    order: List[int] | None,
    site: str,
) -> torch.Tensor:
    """A packed buffer's segments (`counts`, `dtypes` in buffer order) cast to `dtype` and
    concatenated in `order` (segment indices, some or all; None: all in buffer order)."""
    sizes = [segment_bytes(n, d) for n, d in zip(counts, dtypes)]
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + size)
    if order is None:
        order = list(range(len(counts)))
    out = buffers.take(site, sum(counts[i] for i in order), dtype, wire.device)
    start = 0
    for i in order:
        count, segment_dtype = counts[i], dtypes[i]
        if count:
            raw = wire[offsets[i] : offsets[i] + count * segment_dtype.itemsize]
            out[start : start + count].copy_(raw.view(segment_dtype))
        start += count
    return out
