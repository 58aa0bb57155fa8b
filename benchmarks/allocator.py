"""glibc malloc settings a measuring rank runs under (`benchmarks.planner_accuracy`): one for
timing, as `make demo` launches, one for memory."""

from __future__ import annotations

import ctypes
import enum


class Allocator(enum.Enum):
    """glibc's settings a measuring rank runs under (set with `mallopt`, whatever the launch
    environment says), so one command measures both time and memory."""

    TIMING = "timing"  # as `make demo` launches: no mmap, no trim (buffers stay paged in)
    MEMORY = "memory"  # a fixed 128 KiB mmap threshold: freed buffers go back to the OS


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc's malloc.h
_SETTINGS = {
    Allocator.TIMING: ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31)),
    Allocator.MEMORY: (
        (_M_MMAP_MAX, 65536),
        (_M_MMAP_THRESHOLD, 128 * 1024),
        (_M_TRIM_THRESHOLD, 128 * 1024),
    ),
}  # glibc's defaults, held


def set_allocator(kind: Allocator) -> None:
    """Apply `kind` to this process's glibc malloc. Under the timing settings data-parallel's
    freed gradients fragment the heap and peak RSS grows with the step count; under glibc's
    default (dynamic) mmap threshold, whether a buffer is mmapped depends on what was freed
    before: the memory runs hold it at its starting value, 128 KiB. (At 1 MiB, table-row-wise's
    sub-MiB output-dist buffers left 10 MB of free heap pinned under live blocks at 2 x 2
    ranks, d16 b512, that `malloc_trim` gave back: the allocator's layout, not the plan's.)
    Not glibc: an error, not an unknown allocator's figures."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError) as e:
        raise RuntimeError("planner_accuracy measures under glibc's malloc (mallopt)") from e
    for param, value in _SETTINGS[kind]:
        if mallopt(param, value) != 1:
            raise RuntimeError(f"mallopt({param}, {value}) failed")
