"""Fused CPU kernels keep their weights in zeroed, 2 MiB-aligned memory advised for huge pages.

`huge_page_zeros` must behave exactly like `torch.zeros` (contents, dtype, shape) whatever the
kernel grants; on Linux the region must carry the `MADV_HUGEPAGE` advice (`hg` in the
mapping's VmFlags), and an fbgemm kernel with large tables must train on such memory.
"""

from __future__ import annotations

import sys
from typing import List

import pytest
import torch

from recshard.lookup.fused_params import FusedParams
from recshard.lookup.grouped import GroupedLookup
from recshard.lookup.huge_pages import HUGE_PAGE_BYTES, MIN_BYTES, huge_page_zeros
from recshard.lookup.tables import LocalTable
from recshard.modules import EmbeddingBagConfig, PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from recshard.types import EmbeddingComputeKernel

on_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def vm_flags(address: int) -> List[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_buffers_are_aligned_zeros(dtype: torch.dtype) -> None:
    numel = MIN_BYTES // 2 + 3  # not a whole number of huge pages
    buffer = huge_page_zeros(numel, dtype)
    assert buffer.shape == (numel,) and buffer.dtype == dtype and buffer.is_contiguous()
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not buffer.any()
    buffer.fill_(1)  # the whole range is writable
    assert bool((buffer == 1).all())


def test_small_buffers_are_plain_zeros() -> None:
    buffer = huge_page_zeros(100, torch.float32)
    assert buffer.shape == (100,) and not buffer.any()


@on_linux
def test_large_buffers_carry_the_huge_page_advice() -> None:
    buffer = huge_page_zeros(MIN_BYTES // 4, torch.float32)
    assert "hg" in vm_flags(buffer.data_ptr())


@pytest.mark.skipif(not ops.fbgemm_available(), reason="fbgemm not importable")
def test_fbgemm_kernel_trains_on_huge_page_weights() -> None:
    rows, dim = MIN_BYTES // (4 * 16) + 7, 16
    config = EmbeddingBagConfig(
        num_embeddings=rows, embedding_dim=dim, name="t", feature_names=["f"]
    )
    table = LocalTable(
        config,
        rows,
        dim,
        0,
        0,
        EmbeddingComputeKernel.FUSED,
        PoolingType.SUM,
        FusedParams.parse({"optimizer": "exact_sgd", "learning_rate": 0.5}, "t"),
    )
    lookup = GroupedLookup([table], pooled=True, device=torch.device("cpu"))
    weight = lookup.table_weights()[0]
    assert weight.data_ptr() % HUGE_PAGE_BYTES == 0 and weight.shape == (rows, dim)
    assert weight.abs().sum() > 0  # initialized from the config, not left at zero
    before = weight.clone()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.tensor([0, rows - 1, 0]), torch.tensor([2, 1])
    )
    lookup(kjt).sum().backward()
    changed = (weight != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [0, rows - 1]
    torch.testing.assert_close(weight[0], before[0] - 0.5 * 2)  # id 0 twice, gradient 1 each
