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
_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


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


def _gather_index(starts: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """`cat(arange(start, start + count) for each)` in four small ops, not one per range."""
    firsts, total = [], 0
    for start, count in zip(starts, counts):
        firsts.append(start - total)
        total += count
    shift = torch.repeat_interleave(torch.tensor(firsts), torch.tensor(counts), output_size=total)
    return shift.add_(torch.arange(total))


class _Moves:
    """Element ranges to move between two tensors, grouped by (source, dtype) so that each
    group moves in one gather and one scatter (one pass per op whatever the number of keys)
    instead of one slice copy per range, which on CPU costs far more in dispatch than in bytes
    for the ids of a key."""

    def __init__(self) -> None:
        self.groups: dict = {}

    def add(self, key: object, dtype: torch.dtype, src: int, dst: int, count: int) -> None:
        if count:
            group = self.groups.setdefault((key, dtype), ([], [], []))
            group[0].append(src)
            group[1].append(dst)
            group[2].append(count)


def _move(source: torch.Tensor, target: torch.Tensor, moves: List[List[int]]) -> None:
    """`target[dst + i] = source[src + i]` (cast to target's dtype) for every `src, dst, count`
    in `moves` (source starts, target starts, counts)."""
    srcs, dsts, counts = moves
    if len(counts) == 1:  # a plain slice copy is one op already
        src, dst, count = srcs[0], dsts[0], counts[0]
        target[dst : dst + count].copy_(source[src : src + count])
        return
    signed = _SIGNED_TWIN.get(source.dtype)  # index_select has no uint16/32/64 kernel
    index = _gather_index(srcs, counts)
    if signed is None:
        gathered = source.index_select(0, index)
    else:
        gathered = source.view(signed).index_select(0, index).view(source.dtype)
    total = gathered.numel()
    if dsts[0] + total == dsts[-1] + counts[-1] and all(
        dsts[i] + counts[i] == dsts[i + 1] for i in range(len(counts) - 1)
    ):  # the ranges are back to back in the target
        target[dsts[0] : dsts[0] + total].copy_(gathered)
    else:
        gathered = gathered.to(target.dtype)
        signed = _SIGNED_TWIN.get(target.dtype)  # nor index_copy_
        if signed is not None:
            target, gathered = target.view(signed), gathered.view(signed)
        target.index_copy_(0, _gather_index(dsts, counts), gathered)


def pack_segments(segments: Sequence[Segment], site: str) -> torch.Tensor:
    """The segments, each cast to its dtype and padded (`segment_bytes`), back to back: a uint8
    buffer reused per `site` (see `comm/buffers.py`)."""
    sizes = [segment_bytes(s.count, s.dtype) for s in segments]
    device = segments[0].source.device if segments else torch.device("cpu")
    out = buffers.take(site, sum(sizes), torch.uint8, device)
    moves, sources = _Moves(), {}
    offset = 0
    for s, size in zip(segments, sizes):
        sources[id(s.source)] = s.source
        moves.add(id(s.source), s.dtype, s.start, offset // s.dtype.itemsize, s.count)
        offset += size
    for (key, dtype), group in moves.groups.items():
        _move(sources[key], out.view(dtype), group)  # every segment is 8-byte aligned
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
    moves = _Moves()
    start = 0
    for i in order:
        segment_dtype = dtypes[i]
        moves.add(None, segment_dtype, offsets[i] // segment_dtype.itemsize, start, counts[i])
        start += counts[i]
    for (_, segment_dtype), group in moves.groups.items():
        _move(wire.view(segment_dtype), out, group)  # the buffer is 8-byte aligned
    return out
