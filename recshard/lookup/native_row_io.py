"""key_value tables' row I/O in C++ (`csrc/row_io.cpp`), called through ctypes.

`move_rows` reads or writes a batch of rows between a file and a buffer's slots in one call: one
preadv/pwritev per run of consecutive rows, with the GIL released (ctypes drops it), so a prefetch
thread's reads do not queue behind the step for the GIL once per row as a Python loop of os.pread
calls does. Reads can keep several rows in flight (`depth`): rows the page cache does not hold are
read by that many threads at once. The library is built by `pip install` (setup.py's extension
`recshard.lookup._row_io`); `available()` says whether it loaded (a missing build logs one warning
and `RowStore` uses os.pread/os.pwrite). Every tensor the C++ side touches is checked here first
(dtype, shape, contiguity, rows within the file, slots within the buffer), and the C++ side checks
rows and slots again before moving anything."""

from __future__ import annotations

import ctypes
import errno as errno_codes
import os

import torch

from recshard.lookup.native_library import NativeLibrary

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SYSCALL, _SHORT = 3, 4  # row_io.cpp's codes (1, 2: a row or slot out of range)


def _declare(library: ctypes.CDLL) -> None:
    library.rs_rows_io.argtypes = [_int, _int, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _int, _ptr]
    library.rs_rows_io.restype = _int


_LIBRARY = NativeLibrary(
    "recshard.lookup._row_io",
    "row I/O library",
    "key_value tables read and write rows from Python instead (slower)",
    _declare,
    "csrc/row_io.cpp",
)


def available() -> bool:
    """True when the compiled row I/O loaded (warns once when it did not)."""
    return _LIBRARY.load() is not None


def _check_index(name: str, index: torch.Tensor, limit: int, what: str) -> None:
    if index.dtype != torch.int64 or index.dim() != 1 or not index.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D int64 tensor, got {index.dtype} {tuple(index.shape)}"
        )
    if index.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {index.device}")
    if index.numel():
        low, high = (int(v) for v in torch.aminmax(index))
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise ValueError(f"{name}: {bad} is outside the {limit} {what}")


def move_rows(
    write: bool,
    fd: int,
    file_rows: int,
    rows: torch.Tensor,
    buffer: torch.Tensor,
    slots: torch.Tensor | None,
    depth: int = 1,
) -> None:
    """Read (or `write`) file rows `rows` into (from) `buffer`'s slots `slots` (slot i for
    rows[i] when None). A read with `depth` > 1 takes the rows the page cache holds first and
    reads the others from the device `depth` at a time (threads; only when no two rows go to
    one slot, else in order). `buffer` is `[slots, width]` fp32 contiguous; a row of the file is
    `width` fp32 values. Raises ValueError for a buffer or index the call would overrun and
    OSError (with its errno) when a read or write fails or the file ends first."""
    library = _LIBRARY.load()
    if library is None:
        raise RuntimeError("recshard.lookup._row_io is not built")
    if buffer.dtype != torch.float32 or buffer.dim() != 2 or not buffer.is_contiguous():
        raise ValueError(
            "the row buffer must be a contiguous 2-D fp32 tensor, got "
            f"{buffer.dtype} {tuple(buffer.shape)}"
        )
    if buffer.device.type != "cpu":
        raise ValueError(f"the row buffer must be on the CPU, got {buffer.device}")
    _check_index("row ids", rows, file_rows, "rows of the file")
    if slots is None:
        if rows.numel() > buffer.shape[0]:
            raise ValueError(f"{rows.numel()} rows do not fit a buffer of {buffer.shape[0]}")
    else:
        if slots.numel() != rows.numel():
            raise ValueError(f"{slots.numel()} slots for {rows.numel()} rows")
        _check_index("slots", slots, buffer.shape[0], "slots of the buffer")
    if depth < 1:
        raise ValueError(f"the read depth must be at least 1, got {depth}")
    if rows.numel() == 0 or buffer.shape[1] == 0:
        return
    detail = _i64(0)
    code = library.rs_rows_io(
        int(write),
        fd,
        buffer.shape[1] * buffer.element_size(),
        file_rows,
        rows.data_ptr(),
        rows.numel(),
        buffer.data_ptr(),
        buffer.shape[0],
        None if slots is None else slots.data_ptr(),
        depth,
        ctypes.byref(detail),
    )
    if code == _SYSCALL:
        raise OSError(detail.value, os.strerror(detail.value))
    if code == _SHORT:
        raise OSError(errno_codes.EIO, "short write" if write else "short read (file too short)")
    assert code == 0, f"row_io: rejected position {detail.value} ({code}) after the checks"
