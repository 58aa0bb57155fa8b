"""ParallelDropout: the same mask on every rank for replicated activations, a different mask
per rank for sharded ones, its own generators (the global RNG is untouched), a shared seed
broadcast when none is given, and nn.Dropout's scaling and gradient."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import assert_close, checks_of, expect_error

from recshard.parallel import ParallelDropout, mp_gather


def check_parallel_dropout_masks(rank: int, world_size: int) -> None:
    x = torch.ones(32, 32)
    rng_before = torch.get_rng_state()
    replicated = ParallelDropout(0.25, input_is_parallel=False, seed=5)
    sharded = ParallelDropout(0.25, input_is_parallel=True, seed=5)
    rep_out, sh_out = replicated(x), sharded(x)
    again = ParallelDropout(0.25, input_is_parallel=False, seed=5)(x)
    rng_untouched = torch.equal(torch.get_rng_state(), rng_before)
    torch.manual_seed(100 + rank)  # ranks disagree: the seed must come from the first rank
    auto = ParallelDropout(0.25, input_is_parallel=False)
    rep_all = mp_gather(rep_out.unsqueeze(0), 0)
    sh_all = mp_gather(sh_out.unsqueeze(0), 0)
    seeds = mp_gather(torch.tensor([auto.seed]), 0)

    assert rng_untouched, "the global RNG was consumed"
    survivors = rep_out[rep_out != 0]
    assert_close(survivors, torch.full_like(survivors, 1 / 0.75), "survivors scaled by 1 / (1 - p)")
    assert 0.15 < (rep_out == 0).float().mean() < 0.35, "about p of the elements dropped"
    assert torch.equal(rep_out, again), "same seed, same mask"
    assert all(torch.equal(m, rep_all[0]) for m in rep_all), "replicated: one mask on all ranks"
    assert not torch.equal(sh_out, rep_out), "sharded stream differs from the shared one"
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not torch.equal(sh_all[a], sh_all[b]), f"sharded: ranks {a} and {b} share a mask"
    assert len(set(seeds.tolist())) == 1, f"broadcast seed differs across ranks: {seeds.tolist()}"


def check_parallel_dropout_subgroup_seed(rank: int, world_size: int) -> None:
    if world_size != 4:
        return
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(200 + rank)
    drop = ParallelDropout(0.5, pg=groups[rank // 2])
    seeds = mp_gather(torch.tensor([drop.seed]), 0)
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3], f"seeds per pair: {seeds.tolist()}"


def check_parallel_dropout_grad_and_modes(rank: int, world_size: int) -> None:
    drop = ParallelDropout(0.5, seed=3)
    x = torch.randn(6, 10, requires_grad=True)
    y = drop(x)
    y.sum().backward()
    keep = (y != 0).float()
    assert_close(x.grad, keep * 2.0, "gradient is mask / (1 - p)")
    assert_close(y, x.detach() * keep * 2.0, "forward is x * mask / (1 - p)")
    drop.eval()
    assert drop(x) is x, "identity in eval mode"
    assert ParallelDropout(0.0, seed=1)(x) is x
    assert torch.count_nonzero(ParallelDropout(1.0, seed=1)(x)) == 0
    z = torch.ones(4, 4)
    ParallelDropout(0.5, seed=1, inplace=True)(z)
    assert set(z.unique().tolist()) <= {0.0, 2.0}, "inplace"
    expect_error(
        lambda: ParallelDropout(1.5, seed=1), r"ParallelDropout: p must be in \[0, 1\], got 1.5"
    )


@pytest.mark.parametrize("name", [f.__name__ for f in checks_of(sys.modules[__name__])])
def test_parallel_dropout_check_holds_on_every_rank(rank_results, name: str) -> None:
    """Each `check_*` above, run on every rank of a real gloo group, holds there."""
    rank_results.verify(name)
