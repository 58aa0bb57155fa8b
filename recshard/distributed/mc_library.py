"""The managed collision C++ library (`csrc/*.cpp`, the extension
`recshard.distributed._mc_index`) through ctypes: loading it and declaring its functions,
whether a collection uses it (`enabled`), and what every caller does around a call: each tensor
the C++ side reads checked (`vector`), per-item arguments packed (`argument_arrays`), a return
code turned into an error (`check`: MemoryError when the C++ side could not get its scratch and
changed nothing). Its users: `recshard.distributed.mc_native` (index, remap, eviction,
contest, routing), `mc_native_record` (a step's history record) and `mc_native_draw` (a
reset's numbers).
"""

from __future__ import annotations

import ctypes
import os
from typing import List, Sequence, Tuple

import torch

from recshard.lookup.native_library import NativeLibrary

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ERRORS = {
    1: "arguments the library refused",
    2: "an id inserted twice",
    3: "an id to erase that is not held",
    4: "a full index",
    5: "an id outside its range",
    6: "an id routed to a rank not holding its bucket",
    7: "out of memory for scratch (nothing was changed)",
    8: "a C++ exception (nothing was changed)",
}
_NO_MEMORY = 7
ENV = "RECSHARD_NATIVE_MC"


def _declare(library: ctypes.CDLL) -> None:
    signatures = {
        "rs_mc_build": [_i64, _ptr, _i64, _ptr, _ptr],
        "rs_mc_replace": [_i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr],
        "rs_mc_find": [_i64, _ptr, _i64, _ptr, _ptr, _ptr],
        "rs_mc_remap": [_i64, _ptr, _ptr, _i64, _ptr, _i64] + [_ptr] * 7 + [_i64, _ptr, _ptr, _ptr],
        "rs_mc_contest": [_i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr],
        "rs_mc_evict_lfu_tables": [_i64] + [_ptr] * 13 + [_i64, _ptr, _ptr],
        "rs_mc_check_ids": [_i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr],
        "rs_mc_draw_uniform": [_i64] + [_ptr] * 11,
        "rs_mc_route": [_i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64]
        + [_ptr] * 3,
        "rs_mc_record": [_i64, _ptr, _ptr, _i64, _ptr, _i64] + [_ptr] * 6,
    }
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, _int


_LIBRARY = NativeLibrary(
    "recshard.distributed._mc_index",
    "managed collision index library",
    "managed collision remaps and routes ids with torch ops instead (slower)",
    _declare,
    "csrc/mc_index.cpp",
    "csrc/mc_draw.cpp",
    "csrc/mc_route.cpp",
    "csrc/mc_record.cpp",
    "csrc/mc_codes.h",
    "csrc/mc_bucket.h",
    "csrc/mc_contest.h",
    "csrc/mc_segments.h",
)


def available() -> bool:
    """True when the compiled library loaded (warns once when it did not)."""
    return _LIBRARY.load() is not None


def enabled(device: torch.device) -> bool:
    """Whether a collection on `device` remaps in C++: on the CPU, with the library built,
    unless `RECSHARD_NATIVE_MC=0`."""
    return os.environ.get(ENV, "1") != "0" and device.type == "cpu" and available()


def library() -> ctypes.CDLL:
    """The loaded library (RuntimeError when it is not built)."""
    library = _LIBRARY.load()
    if library is None:
        raise RuntimeError("recshard.distributed._mc_index is not built")
    return library


def vector(
    name: str, tensor: torch.Tensor, numel: int | None = None, dtype: torch.dtype = torch.int64
) -> int:
    """`tensor`'s data pointer after checking it is what the C++ side reads: 1-D, contiguous,
    on the CPU, of `dtype` and (when given) `numel` elements."""
    if tensor.dtype != dtype or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D {dtype} tensor, got {tensor.dtype} "
            f"{tuple(tensor.shape)}"
        )
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {tensor.device}")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {tensor.numel()}")
    return tensor.data_ptr()


def check(code: int, what: str) -> None:
    """Raises for a nonzero return code: MemoryError when the C++ side could not allocate its
    scratch (it changed nothing: the call may be retried), else RuntimeError."""
    if code:
        error = MemoryError if code == _NO_MEMORY else RuntimeError
        raise error(f"managed collision {what}: {_ERRORS.get(code, f'code {code}')}")


def argument_arrays(
    columns: Sequence[Sequence[float]], width: int, dtype: torch.dtype
) -> Tuple[torch.Tensor, List[int]]:
    """Per-item arguments (`columns`: one tuple of `width` values per table or draw) as the
    C++ side reads them, one array per argument: the `[width, items]` tensor (keep it alive
    through the call) and each array's address."""
    items = len(columns)
    arrays = torch.tensor(columns, dtype=dtype, device="cpu").reshape(items, width).t().contiguous()
    step = arrays.element_size() * items
    return arrays, [arrays.data_ptr() + step * f for f in range(width)]


def segment_arguments(
    ids: torch.Tensor, segment_tables: torch.Tensor, segment_lengths: torch.Tensor
) -> Tuple[int, int, int, int, int]:
    """The leading arguments of a call over ids laid out in segments (`segment_lengths[s]` ids
    of table `segment_tables[s]`), checked: the segment count, both arrays' addresses, the ids'
    count and address."""
    segments = segment_tables.numel()
    return (
        segments,
        vector("segment tables", segment_tables),
        vector("segment lengths", segment_lengths, segments),
        ids.numel(),
        vector("ids", ids),
    )
