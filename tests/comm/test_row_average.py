"""`average_rows_over_ranks` equals the dense all-reduce mean, on both of its paths.

Each rank rebuilds every rank's gradient from seeds, so the expected mean is computed
locally; the call itself runs for real over gloo. All cases of one world size share a group.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from multiprocess import run_ranks

from recshard.comm import average_rows_over_ranks

ROWS, DIM = 40, 3


def rank_grad(case: str, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(gradient, looked-up ids): few rows, shared rows, one rank only, most rows, none."""
    g = torch.Generator().manual_seed(100 * rank + len(case))
    ids = {
        "few_rows": torch.tensor([rank, 7, 30 + rank, 7]),  # shared row 7, private rows
        "one_rank_only": torch.tensor([5, 6]) if rank == 0 else torch.tensor([], dtype=torch.long),
        "most_rows": torch.arange(rank % 2, ROWS),  # the dense all-reduce
        "none": torch.tensor([], dtype=torch.long),
        "nan_row": torch.tensor([11, 12]),
    }[case]
    grad = torch.zeros(ROWS, DIM)
    grad[ids] = torch.randn(ids.numel(), DIM, generator=g)
    if case == "nan_row" and rank == 0:
        grad[12, 1] = float("nan")
    if case == "few_rows":
        grad[7] = 0.0  # a looked-up row may hold exact zeros
    return grad, ids


CASES = ["few_rows", "one_rank_only", "most_rows", "none", "nan_row"]


def check_all(rank: int, world_size: int) -> Dict[str, List[str]]:
    problems: Dict[str, List[str]] = {}
    for case in CASES:
        expected = sum(rank_grad(case, r)[0] for r in range(world_size)) / world_size
        grad, ids = rank_grad(case, rank)
        out = average_rows_over_ranks(grad, ids)
        found = []
        if out.data_ptr() != grad.data_ptr():
            found.append("not in place")
        if not torch.allclose(out, expected, equal_nan=True):
            found.append(f"differs by {(out - expected).abs().nan_to_num(float('inf')).max()}")
        problems[case] = found
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
def test_row_average_equals_dense_mean(world_size: int) -> None:
    results = run_ranks(world_size, check_all, timeout=120)
    failures = {
        (rank, case): p
        for rank, per_case in enumerate(results)
        for case, p in per_case.items()
        if p
    }
    assert not failures, failures
