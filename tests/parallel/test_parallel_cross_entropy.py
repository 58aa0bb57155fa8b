"""vocab_parallel_cross_entropy / ParallelCrossEntropyLoss / VocabParallelClassifier against
F.cross_entropy on the gathered logits: every reduction, ignore_index, class weights and
label smoothing, values and logit gradients, including logits far too large for a naive exp."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
import torch.nn.functional as F
from parallel_helpers import assert_close, checks_of, expect_error, seeded, shard
from torch import nn

from recshard.parallel import (
    ParallelCrossEntropyLoss,
    VocabParallelClassifier,
    vocab_parallel_cross_entropy,
)

C = 12  # classes, divisible by 1, 2 and 4


def _targets(shape: tuple, seed: int, ignore_index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, C, shape, generator=g)
    target.view(-1)[::4] = ignore_index  # every 4th row ignored
    return target


def check_cross_entropy_matches_f_cross_entropy(rank: int, world_size: int) -> None:
    class_weight = seeded(31, C).abs() + 0.1
    grid = [
        ((2, 5), reduction, weighted, smoothing, ignore_index, 1.0)
        for reduction, weighted, smoothing, ignore_index in itertools.product(
            ("mean", "sum", "none"), (False, True), (0.0, 0.2), (-100, 3)
        )
    ]  # plus logits whose exp overflows float32 unless the max is taken out first
    grid += [((7,), reduction, True, 0.2, -100, 1000.0) for reduction in ("mean", "sum", "none")]
    for shape, reduction, weighted, smoothing, ignore_index, scale in grid:
        case = (
            f"shape={shape} {reduction} weight={weighted} ls={smoothing} "
            f"ignore={ignore_index} scale={scale}"
        )
        full = seeded(32, *shape, C) * scale
        target = _targets(shape, 33, ignore_index)
        weight = class_weight if weighted else None
        kwargs = dict(
            weight=weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing
        )

        ref_logits = full.clone().requires_grad_()
        expected = F.cross_entropy(ref_logits.reshape(-1, C), target.reshape(-1), **kwargs)
        expected = expected.reshape(shape) if reduction == "none" else expected
        upstream = seeded(34, *expected.shape)
        (expected * upstream).sum().backward()

        logits = shard(full, -1, rank, world_size).requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, target, **kwargs)
        (loss * upstream).sum().backward()
        assert torch.isfinite(loss).all(), f"{case}: not finite"
        tol = {"rtol": 1e-5, "atol": 1e-5 * scale}
        assert_close(loss, expected.detach(), f"{case} loss", **tol)
        assert_close(
            logits.grad, shard(ref_logits.grad, -1, rank, world_size), f"{case} logit grad", **tol
        )


def check_classifier_and_loss_module(rank: int, world_size: int) -> None:
    x = seeded(35, 6, 8)
    target = torch.tensor([0, 11, 5, -100, 7, 3])
    torch.manual_seed(36)
    ref_head = nn.Linear(8, C)
    torch.manual_seed(36)
    head = VocabParallelClassifier(8, C)
    weight = seeded(37, C).abs()
    ref_loss_fn = nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    loss_fn = ParallelCrossEntropyLoss(weight=weight, label_smoothing=0.1)

    ref_x = x.clone().requires_grad_()
    expected = ref_loss_fn(ref_head(ref_x), target)
    expected.backward()
    leaf = x.clone().requires_grad_()
    logits = head(leaf)
    assert logits.shape == (6, C // world_size)
    loss = loss_fn(logits, target)
    loss.backward()
    assert_close(loss, expected.detach(), "loss")
    assert_close(leaf.grad, ref_x.grad, "input grad")
    assert_close(
        head.weight.grad, shard(ref_head.weight.grad, 0, rank, world_size), "head weight grad"
    )
    assert_close(head.bias.grad, shard(ref_head.bias.grad, 0, rank, world_size), "head bias grad")


def check_cross_entropy_half_precision(rank: int, world_size: int) -> None:
    full = seeded(38, 5, C) * 30
    target = torch.tensor([1, 2, 3, 4, 11])
    expected = F.cross_entropy(full, target)
    loss = vocab_parallel_cross_entropy(shard(full, -1, rank, world_size).bfloat16(), target)
    assert loss.dtype == torch.bfloat16
    assert_close(loss.float(), expected, "bf16 loss", rtol=2e-2, atol=2e-2)


def check_cross_entropy_errors(rank: int, world_size: int) -> None:
    logits = torch.zeros(4, C // world_size)
    good = torch.tensor([0, 1, 2, 3])
    name = "vocab_parallel_cross_entropy"
    expect_error(
        lambda: vocab_parallel_cross_entropy(logits, torch.tensor([0, 1, C, 3])),
        rf"^{name}: target {C} is out of range \[0, {C}\) \(and is not ignore_index=-100\)$",
    )
    expect_error(
        lambda: vocab_parallel_cross_entropy(logits, torch.tensor([0, -1, 2, 3])),
        r"target -1 is out of range",
    )
    expect_error(
        lambda: vocab_parallel_cross_entropy(logits, good[:3]),
        r"target shape \(3,\) must equal the logits shape without the class dim, \(4,\)",
    )
    expect_error(
        lambda: vocab_parallel_cross_entropy(logits, good.float()),
        r"target must hold class indices",
    )
    expect_error(
        lambda: vocab_parallel_cross_entropy(logits, good, reduction="avg"),
        r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'",
    )
    expect_error(
        lambda: vocab_parallel_cross_entropy(logits, good, weight=torch.ones(C // world_size + 1)),
        rf"weight must have shape \({C},\) \(all classes, not a shard\)",
    )
    expect_error(
        lambda: vocab_parallel_cross_entropy(logits, good, label_smoothing=1.5),
        r"label_smoothing must be in \[0, 1\], got 1.5",
    )
    expect_error(
        lambda: ParallelCrossEntropyLoss(reduction="max"),
        r"ParallelCrossEntropyLoss: reduction must be one of",
    )


@pytest.mark.parametrize("name", [f.__name__ for f in checks_of(sys.modules[__name__])])
def test_parallel_cross_entropy_check_holds_on_every_rank(rank_results, name: str) -> None:
    """Each `check_*` above, run on every rank of a real gloo group, holds there."""
    rank_results.verify(name)
