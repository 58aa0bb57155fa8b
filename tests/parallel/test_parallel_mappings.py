"""mp_copy / mp_reduce / mp_scatter / mp_gather / mp_reduce_scatter / mp_all_gather:
forward values and input gradients against what the single-process math says.

Every rank rebuilds every rank's input and upstream gradient from seeds, so it can compute
the expected result of the collective alone.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import assert_close, checks_of, expect_error, seeded

from recshard.parallel import (
    mp_all_gather,
    mp_copy,
    mp_gather,
    mp_reduce,
    mp_reduce_scatter,
    mp_scatter,
)


def check_mp_copy(rank: int, world_size: int) -> None:
    x = seeded(1, 3, 4).requires_grad_()
    y = mp_copy(x)
    (y * seeded(100 + rank, 3, 4)).sum().backward()
    assert_close(y, x.detach(), "forward is identity")
    expected = sum(seeded(100 + r, 3, 4) for r in range(world_size))
    assert_close(x.grad, expected, "backward all-reduces")


def check_mp_reduce(rank: int, world_size: int) -> None:
    inputs = [seeded(10 + r, 3, 4) for r in range(world_size)]
    stacked = torch.stack(inputs)
    upstream = seeded(7, 3, 4)
    cases = {
        "sum": (stacked.sum(0), lambda x, y: upstream),
        dist.ReduceOp.SUM: (stacked.sum(0), lambda x, y: upstream),
        "avg": (stacked.mean(0), lambda x, y: upstream / world_size),
        dist.ReduceOp.AVG: (stacked.mean(0), lambda x, y: upstream / world_size),
        "max": (stacked.amax(0), lambda x, y: upstream * (x == y)),
        dist.ReduceOp.MIN: (stacked.amin(0), lambda x, y: upstream * (x == y)),
    }
    for op, (expected, expected_grad) in cases.items():
        x = inputs[rank].clone().requires_grad_()
        y = mp_reduce(x, op=op)
        (y * upstream).sum().backward()
        assert_close(y, expected, f"mp_reduce({op}) forward")
        assert_close(x.grad, expected_grad(x.detach(), expected), f"mp_reduce({op}) backward")
    expect_error(
        lambda: mp_reduce(inputs[rank], op="product"), r"unsupported reduction op 'product'"
    )


def check_mp_scatter(rank: int, world_size: int) -> None:
    for dim in (-1, 0, 1):
        full = seeded(2, 4, 8, 3) if dim != -1 else seeded(2, 4, 3, 8)
        x = full.clone().requires_grad_()
        y = mp_scatter(x, dim)
        upstream = [seeded(200 + r, *y.shape) for r in range(world_size)]
        (y * upstream[rank]).sum().backward()
        assert_close(y, full.chunk(world_size, dim)[rank], f"scatter dim {dim} forward")
        assert_close(x.grad, torch.cat(upstream, dim), f"scatter dim {dim} backward all-gathers")


def check_mp_gather(rank: int, world_size: int) -> None:
    for dim in (-1, 0):
        shards = [seeded(30 + r, 2, 3) for r in range(world_size)]
        x = shards[rank].clone().requires_grad_()
        y = mp_gather(x, dim)
        upstream = seeded(8, *y.shape)
        (y * upstream).sum().backward()
        assert_close(y, torch.cat(shards, dim), f"gather dim {dim} forward")
        assert_close(x.grad, upstream.chunk(world_size, dim)[rank], f"gather dim {dim} backward")


def check_mp_reduce_scatter_and_all_gather(rank: int, world_size: int) -> None:
    inputs = [seeded(40 + r, 2, 4 * world_size, 3) for r in range(world_size)]
    x = inputs[rank].clone().requires_grad_()
    y = mp_reduce_scatter(x, 1)
    upstream = [seeded(300 + r, *y.shape) for r in range(world_size)]
    (y * upstream[rank]).sum().backward()
    assert_close(y, sum(inputs).chunk(world_size, 1)[rank], "reduce-scatter forward")
    assert_close(x.grad, torch.cat(upstream, 1), "reduce-scatter backward all-gathers")

    shards = [seeded(50 + r, 2, 3, 5) for r in range(world_size)]
    x = shards[rank].clone().requires_grad_()
    y = mp_all_gather(x, 1)
    upstream = [seeded(400 + r, *y.shape) for r in range(world_size)]
    (y * upstream[rank]).sum().backward()
    assert_close(y, torch.cat(shards, 1), "all-gather forward")
    expected = sum(upstream).chunk(world_size, 1)[rank]
    assert_close(x.grad, expected, "all-gather backward reduce-scatters")


def check_mapping_errors(rank: int, world_size: int) -> None:
    expect_error(lambda: mp_gather(torch.tensor(1.0)), r"mp_gather: cannot gather 0-d")
    if world_size == 1:
        return
    bad = torch.zeros(2, world_size + 1)
    expect_error(
        lambda: mp_scatter(bad, -1),
        rf"mp_scatter: cannot split dim -1 of size {world_size + 1} .* group of size {world_size}",
    )
    expect_error(lambda: mp_reduce_scatter(bad, 1), r"mp_reduce_scatter: cannot split dim 1")


@pytest.mark.parametrize("name", [f.__name__ for f in checks_of(sys.modules[__name__])])
def test_mp_mapping_check_holds_on_every_rank(rank_results, name: str) -> None:
    """Each `check_*` above, run on every rank of a real gloo group, holds there."""
    rank_results.verify(name)


def test_single_process_without_init() -> None:
    """Without a process group every primitive is the identity (a group of one)."""
    assert not torch.distributed.is_initialized()
    x = torch.randn(2, 4)
    for fn in (mp_copy, mp_reduce, mp_scatter, mp_gather):
        assert torch.equal(fn(x), x)
