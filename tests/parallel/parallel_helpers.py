"""Helpers for the tensor-parallel tests: a check registry run inside one process group per
world size, and small tools shared by the checks (seeded tensors, shards, error matching).

A check is `check_*(rank, world_size)` in a module listed in CHECK_MODULES. It builds the
single-process reference and the parallel version on every rank and asserts they agree.
Checks do all their collectives before asserting, so a failing check does not leave the other
ranks waiting inside a collective and the next check starts in step.
"""

from __future__ import annotations

import importlib
import re
import traceback
from typing import Any, Callable, Dict, List, Type

import pytest
import torch

CHECK_MODULES = [
    "test_parallel_mappings",
    "test_parallel_linear",
    "test_parallel_embedding",
    "test_parallel_cross_entropy",
    "test_parallel_dropout",
    "test_parallel_style",
]

Check = Callable[[int, int], None]


def checks_of(module: Any) -> List[Check]:
    """The check functions a test module defines, in definition order."""
    return [fn for name, fn in vars(module).items() if name.startswith("check_") and callable(fn)]


def run_all_checks(rank: int, world_size: int, module_names: List[str]) -> Dict[str, str]:
    """Run every check of every module; map check name -> "" (passed) or its traceback."""
    torch.manual_seed(0)
    outcome: Dict[str, str] = {}
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - a broken module fails its own tests, not the rest
            outcome[f"import {module_name}"] = traceback.format_exc()
            continue
        for check in checks_of(module):
            try:
                check(rank, world_size)
                outcome[check.__name__] = ""
            except Exception:  # noqa: BLE001 - reported per check to the parent
                outcome[check.__name__] = traceback.format_exc()
    return outcome


class RankResults:
    """Per-rank outcomes of one process group; `verify(name)` fails with the tracebacks."""

    def __init__(self, world_size: int, per_rank: List[Dict[str, str]]) -> None:
        self.world_size, self.per_rank = world_size, per_rank

    def verify(self, name: str) -> None:
        broken = [
            tb for out in self.per_rank[:1] for key, tb in out.items() if key.startswith("import")
        ]
        missing = [r for r, out in enumerate(self.per_rank) if name not in out]
        assert not missing, f"check {name} did not run on ranks {missing}" + "".join(broken)
        failed = {r: out[name] for r, out in enumerate(self.per_rank) if out[name]}
        if failed:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items())
            pytest.fail(f"{name} failed at world size {self.world_size}:{detail}", pytrace=False)


def seeded(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A reproducible random tensor, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def shard(
    full: torch.Tensor, dim: int, rank: int, world_size: int, stride: int = 1
) -> torch.Tensor:
    """Rank `rank`'s slice of `full` along `dim` (with `stride` interleaved chunks)."""
    chunks = full.chunk(world_size * stride, dim=dim)
    return torch.cat([chunks[s * world_size + rank] for s in range(stride)], dim=dim)


def assert_close(actual: Any, expected: Any, what: str, **tol: float) -> None:
    if isinstance(actual, torch.Tensor) and actual.is_sparse:
        actual = actual.to_dense()
    if isinstance(expected, torch.Tensor) and expected.is_sparse:
        expected = expected.to_dense()
    tol = tol or {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)


def expect_error(fn: Callable[[], Any], match: str, error: Type[BaseException] = ValueError) -> str:
    """Call `fn`, require `error` whose message matches the regex `match`; return the message."""
    try:
        fn()
    except error as err:
        message = str(err)
        if not re.search(match, message):
            raise AssertionError(f"error message {message!r} does not match {match!r}") from err
        return message
    raise AssertionError(f"expected {error.__name__} matching {match!r}, nothing was raised")


def grads(*tensors: torch.Tensor | None) -> List[torch.Tensor | None]:
    return [None if t is None or t.grad is None else t.grad.clone() for t in tensors]
