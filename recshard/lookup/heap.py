"""Keep a CPU training step's temporaries in glibc's heap instead of handing them back to the
kernel after every step.

A sharded CPU step allocates tens of MB of temporaries (kernel outputs, autograd activations
and gradients, the ids' sort in the fused backward) and frees them at its end. Under glibc's
defaults the freed top of the heap is trimmed (`brk` down) once it passes the trim threshold
and allocations over the (dynamic) mmap threshold are mmapped and unmapped each time: every
step then page-faults its temporaries in again (measured in `benchmarks/README.md`).
`keep_step_buffers_in_heap` sets, once per process, what `MALLOC_MMAP_THRESHOLD_` /
`MALLOC_TRIM_THRESHOLD_` would: buffers under 32 MiB (glibc's largest mmap threshold) come
from the heap, and the heap is never trimmed, so a step reuses the pages the step before it
freed. Bigger buffers (tables) are still mmapped and go back to the system when freed.

Best effort and glibc only. A process whose environment sets any glibc malloc variable
(`MALLOC_*_` or `GLIBC_TUNABLES` with `glibc.malloc.`) keeps its own choice: nothing is
changed then.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Callable

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # the largest int: never trim
_USER_VARIABLES = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TOP_PAD_",
)
_done = False
_declined = False
GLIBC_THRESHOLD = 128 * 1024  # glibc's default trim and (initial) mmap thresholds


def user_chose_malloc_settings() -> bool:
    """Whether this process's environment sets glibc's malloc itself."""
    return any(v in os.environ for v in _USER_VARIABLES) or "glibc.malloc." in os.environ.get(
        "GLIBC_TUNABLES", ""
    )


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's `mallopt` (None off Linux, on another libc, or where the environment chose)."""
    if not sys.platform.startswith("linux") or user_chose_malloc_settings():
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing  # noqa: B018
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt


def keep_step_buffers_in_heap() -> bool:
    """Set glibc's mmap threshold to 32 MiB and turn heap trimming off, once per process
    (see the module docstring), unless `leave_heap_to_glibc` ran. True if this call or an
    earlier one set them."""
    global _done
    if _done or _declined:
        return _done
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # the mmap threshold first: setting either fixes both (glibc's dynamic threshold stops)
    if (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1
        or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1
    ):
        logger.debug("mallopt refused the heap settings")
        return False
    _done = True
    return True


def leave_heap_to_glibc() -> None:
    """Keep glibc's own heap settings in this process from now on, undoing
    `keep_step_buffers_in_heap` if it ran: a process with key-value tables is held to a DRAM
    budget, and a heap that is never trimmed would keep a step's freed temporaries resident
    beyond it."""
    global _done, _declined
    _declined = True
    mallopt = _mallopt() if _done else None
    if mallopt is not None:
        mallopt(_M_TRIM_THRESHOLD, GLIBC_THRESHOLD)
        mallopt(_M_MMAP_THRESHOLD, GLIBC_THRESHOLD)
    _done = False
