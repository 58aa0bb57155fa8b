"""The key_value row cache's per-batch bookkeeping in C++ (`csrc/row_cache.cpp`), via ctypes.

`assign` does for one table's batch of ids, in one foreign call with the GIL released, what
`key_value._RowCache` does in torch without the library: the distinct rows, CLOCK reference
bits, a slot for each row not cached (victims chosen by the CLOCK hand), the updated victims
listed in row order for the write-back, the row <-> slot maps, and for a forward every id's
slot and the pins of its slots. `release` unpins a forward's slots and marks them updated. The
library is built by `pip install` (setup.py's extension `recshard.lookup._row_cache`);
`available()` says whether it loaded (a missing build logs one warning and the cache runs its
torch path). Every tensor the C++ side touches is checked here first (dtype, shape,
contiguity, ids within the table), so a wrong buffer is a ValueError, never an overrun.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from recshard.lookup.native_library import NativeLibrary

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_BAD_ID, _OVERFLOW, _BAD_STATE = 1, 2, 3  # row_cache.cpp's codes


def _declare(library: ctypes.CDLL) -> None:
    library.rc_assign.argtypes = [_ptr, _i64, _i64, *[_ptr] * 6, _ptr, _i64, _ptr, _int, _int]
    library.rc_assign.argtypes += [_ptr] * 8
    library.rc_assign.restype = _int
    library.rc_release.argtypes = [_ptr, _i64, _ptr, _ptr, _int]
    library.rc_release.restype = None


_LIBRARY = NativeLibrary(
    "recshard.lookup._row_cache",
    "row cache library",
    "key_value tables keep their caches' books in torch instead (slower)",
    _declare,
    "csrc/row_cache.cpp",
)


def available() -> bool:
    """True when the compiled row cache loaded (warns once when it did not)."""
    return _LIBRARY.load() is not None


class CacheOverflow(Exception):
    """A batch's `needed` rows not cached outnumber the `free` slots; nothing changed."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(needed, free)
        self.needed, self.free = needed, free


@dataclass
class CacheArrays:
    """One cache's slot state, shared by the C++ and the torch path."""

    row_slot: torch.Tensor  # [rows] int32: a row's slot, -1 when not cached
    slot_row: torch.Tensor  # [capacity] int64: a slot's row, -1 when empty
    referenced: torch.Tensor  # [capacity] bool: CLOCK's second-chance bit
    fresh: torch.Tensor  # [capacity] bool: brought in, no forward read it yet
    dirty: torch.Tensor  # [capacity] bool: updated since read from storage
    pins: torch.Tensor  # [capacity] int32: forwards in flight reading the slot
    scratch: torch.Tensor  # [capacity] uint8: a call's marks (zero between calls)
    cursor: torch.Tensor  # [2] int64: the CLOCK hand, slots [filled, capacity) never used

    BYTES_PER_SLOT = 8 + 4 + 4  # slot_row, pins, four flags

    @staticmethod
    def empty(rows: int, capacity: int) -> CacheArrays:
        return CacheArrays(
            row_slot=torch.full((rows,), -1, dtype=torch.int32),
            slot_row=torch.full((capacity,), -1, dtype=torch.int64),
            referenced=torch.zeros(capacity, dtype=torch.bool),
            fresh=torch.zeros(capacity, dtype=torch.bool),
            dirty=torch.zeros(capacity, dtype=torch.bool),
            pins=torch.zeros(capacity, dtype=torch.int32),
            scratch=torch.zeros(capacity, dtype=torch.uint8),
            cursor=torch.zeros(2, dtype=torch.int64),
        )

    def check(self) -> None:
        """Raise ValueError unless every array has the dtype and size the C++ call assumes."""
        capacity = self.slot_row.numel()
        want = {
            "row_slot": (torch.int32, self.row_slot.numel()),
            "slot_row": (torch.int64, capacity),
            "referenced": (torch.bool, capacity),
            "fresh": (torch.bool, capacity),
            "dirty": (torch.bool, capacity),
            "pins": (torch.int32, capacity),
            "scratch": (torch.uint8, capacity),
            "cursor": (torch.int64, 2),
        }
        for name, (dtype, size) in want.items():
            _check_1d(name, getattr(self, name), dtype, size)
        hand, filled = self.cursor.tolist()
        if capacity and not (0 <= hand < capacity and 0 <= filled <= capacity):
            raise ValueError(f"cache cursor (hand {hand}, filled {filled}) outside {capacity}")


def _check_1d(name: str, tensor: torch.Tensor, dtype: torch.dtype, size: int) -> None:
    if (
        tensor.dtype != dtype
        or tensor.dim() != 1
        or tensor.numel() != size
        or not tensor.is_contiguous()
        or tensor.device.type != "cpu"
    ):
        raise ValueError(
            f"cache array '{name}' must be a contiguous 1-D {dtype} CPU tensor of {size}, got "
            f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
        )


@dataclass
class Assignment:
    """What `assign` decided."""

    missing: torch.Tensor  # rows to read, sorted
    victims: torch.Tensor  # their slots
    dirty_rows: torch.Tensor  # updated victims' old rows, sorted, to write back
    dirty_slots: torch.Tensor  # their slots
    distinct: int  # distinct rows of the batch
    pinned: torch.Tensor  # the forward's distinct slots, pinned (empty without `pin`)


def assign(
    arrays: CacheArrays,
    ids: torch.Tensor,
    id_slots: torch.Tensor | None,
    pin: bool,
) -> Assignment:
    """Bring rows `ids` (int64, any order, repeats) into the cache's books; with `id_slots`
    (int64 `[len(ids)]`) a forward reads them: each id's slot is written there, the rows are
    no longer fresh and, with `pin`, their slots stay pinned until `release`. Raises
    `CacheOverflow` (nothing changed) when the rows not cached do not fit."""
    library = _LIBRARY.load()
    if library is None:
        raise RuntimeError("recshard.lookup._row_cache is not built")
    arrays.check()
    rows, capacity = arrays.row_slot.numel(), arrays.slot_row.numel()
    _check_1d("ids", ids, torch.int64, ids.numel())
    if ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= rows:
            raise ValueError(f"row id {low if low < 0 else high} is outside the {rows} rows")
    if id_slots is not None:
        _check_1d("id_slots", id_slots, torch.int64, ids.numel())
    if pin and id_slots is None:
        raise ValueError("only a forward (id_slots given) pins its slots")
    # the outputs: missing rows, their slots, updated victims' rows and slots, pinned slots
    # (each at most min(ids, capacity) long), then the four counts
    size = min(ids.numel(), capacity)
    out = torch.empty(5 * size + 4, dtype=torch.int64)
    missing, victims, dirty_rows, dirty_slots, pinned = out[: 5 * size].view(5, size)
    counts = out[5 * size :]
    detail = _i64(0)
    code = library.rc_assign(
        ids.data_ptr(),
        ids.numel(),
        rows,
        *[
            t.data_ptr()
            for t in (arrays.row_slot, arrays.slot_row, arrays.referenced, arrays.fresh)
        ],
        arrays.dirty.data_ptr(),
        arrays.pins.data_ptr(),
        arrays.scratch.data_ptr(),
        capacity,
        arrays.cursor.data_ptr(),
        int(id_slots is not None),
        int(pin),
        None if id_slots is None else id_slots.data_ptr(),
        *[t.data_ptr() for t in (missing, victims, dirty_rows, dirty_slots, pinned, counts)],
        ctypes.byref(detail),
    )
    if code == _OVERFLOW:
        raise CacheOverflow(int(counts[0]), detail.value)
    if code == _BAD_STATE:
        raise ValueError(f"the cache's row/slot maps are corrupt (at {detail.value})")
    assert code == 0, f"row_cache: rejected id at {detail.value} ({code}) after the checks"
    misses, distinct, written, pinned_count = counts.tolist()
    return Assignment(
        missing[:misses],
        victims[:misses],
        dirty_rows[:written],
        dirty_slots[:written],
        distinct,
        pinned[:pinned_count],
    )


def release(arrays: CacheArrays, slots: torch.Tensor, updated: bool) -> None:
    """Unpin a forward's distinct `slots` (as `assign` pinned them); `updated` marks them dirty."""
    library = _LIBRARY.load()
    if library is None:
        raise RuntimeError("recshard.lookup._row_cache is not built")
    capacity = arrays.slot_row.numel()
    _check_1d("slots", slots, torch.int64, slots.numel())
    _check_1d("pins", arrays.pins, torch.int32, capacity)
    _check_1d("dirty", arrays.dirty, torch.bool, capacity)
    if slots.numel():
        low, high = (int(v) for v in torch.aminmax(slots))
        if low < 0 or high >= capacity:
            raise ValueError(f"slot {low if low < 0 else high} is outside the {capacity} slots")
    library.rc_release(
        slots.data_ptr(), slots.numel(), arrays.pins.data_ptr(), arrays.dirty.data_ptr(), updated
    )
