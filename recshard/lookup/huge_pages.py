"""Zeroed CPU buffers on transparent huge pages, for the weights of fused lookup kernels.

A lookup reads, and the fused update writes, rows scattered over hundreds of MB: with 4 KiB
pages nearly every row costs a TLB miss (a two-level page walk under a hypervisor). Memory
advised `MADV_HUGEPAGE` before its first touch gets 2 MiB pages wherever the kernel allows
them (THP mode `madvise` or `always`); fbgemm's CPU forward + exact-SGD backward on the
benchmark's 370 MB of tables ran ~15% faster so (`benchmarks/README.md`).

Best effort: off Linux, under THP `never`, or when `madvise` is refused, the buffer is
ordinary memory with the same contents; nothing but speed depends on it.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# Smaller buffers keep the allocator's memory: a huge page would mostly be padding.
MIN_BYTES = 4 * HUGE_PAGE_BYTES
_MADV_HUGEPAGE = 14  # linux/mman.h


def _advise_huge(address: int, length: int) -> bool:
    """`madvise(address, length, MADV_HUGEPAGE)`; False where that is refused or unknown."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D contiguous CPU tensor of `numel` zeros, 2 MiB-aligned and advised for huge
    pages before its first touch (small buffers: plain `torch.zeros`)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < MIN_BYTES:
        return torch.zeros(numel, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)  # untouched pages
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    region = raw[start : start + nbytes]
    _advise_huge(region.data_ptr(), nbytes - nbytes % HUGE_PAGE_BYTES)
    return region.view(dtype).zero_()
