"""Receive buffers reused across steps: a buffer's memory is handed out again only once no
tensor (view, detached alias, collective in flight) holds it any more."""

from __future__ import annotations

import torch

from recshard.comm import buffers

BIG = 1 << 20  # elements: above the size the pool keeps


def test_memory_comes_back_once_every_alias_is_gone() -> None:
    buffers.clear()
    first = buffers.take("site", BIG, torch.float32, torch.device("cpu"))
    address = first.data_ptr()
    alias = first.detach()[: BIG // 2]  # no autograd view link to `first`
    del first
    second = buffers.take("site", BIG, torch.float32, torch.device("cpu"))
    assert second.data_ptr() != address  # the alias still holds the first memory
    del alias
    third = buffers.take("site", BIG, torch.float32, torch.device("cpu"))
    assert third.data_ptr() == address and third.numel() == BIG
    assert third._base is None  # a plain tensor: in-place ops and autograd treat it as such


def test_sites_dtypes_and_small_sizes_never_share() -> None:
    buffers.clear()
    a = buffers.take("a", BIG, torch.float32, torch.device("cpu"))
    address = a.data_ptr()
    del a
    assert buffers.take("b", BIG, torch.float32, torch.device("cpu")).data_ptr() != address
    assert buffers.take("a", BIG, torch.int32, torch.device("cpu")).data_ptr() != address
    assert buffers.take("a", 4 * BIG, torch.float32, torch.device("cpu")).data_ptr() != address
    assert buffers.take("a", 16, torch.float32, torch.device("cpu")).numel() == 16
    assert not any(site == "a" and numel == 16 for site, numel in buffers.kept())


def test_a_shorter_request_gets_a_view_sized_to_it() -> None:
    buffers.clear()
    a = buffers.take("s", BIG, torch.int64, torch.device("cpu"))
    address = a.data_ptr()
    del a
    b = buffers.take("s", BIG - 10, torch.int64, torch.device("cpu"))
    assert b.data_ptr() == address and b.shape == (BIG - 10,)
    b.fill_(3)  # writable in place
    assert int(b.sum()) == 3 * (BIG - 10)
