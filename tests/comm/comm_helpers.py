"""Helpers shared by the comm tests: seeded per-rank inputs and gradient checks."""

from __future__ import annotations

from typing import Callable, List

import torch


def seeded(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A reproducible random tensor: every rank can rebuild every other rank's input."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def reference_grads(
    inputs: List[torch.Tensor],
    reference: Callable[[List[torch.Tensor]], List[torch.Tensor]],
    weights: List[torch.Tensor],
) -> List[torch.Tensor]:
    """Gradients of `sum_r <reference(inputs)[r], weights[r]>` w.r.t. every rank's input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = reference(leaves)
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, **tol: float) -> None:
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)
