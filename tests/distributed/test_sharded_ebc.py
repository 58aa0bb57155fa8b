"""Sharded EBC == unsharded EBC: forward (values and keys), gradients, and tables and fused
optimizer state after 1 and 3 optimizer steps.

Every sharding type and a mixed plan, fused (SGD, row-wise Adagrad) and dense kernels,
weighted and unweighted, at world sizes 1-4; one spawned group per world size runs every case.
`shared` cases use features read by several tables (outputs `f@t`), in every sharding type
and in a mixed plan where each shared feature's tables have different sharding types.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch
from ebc_cases import (
    KINDS,
    batch,
    global_batch,
    make_ebc,
    output_grad,
    shard_reference,
    step_reference_and_compare,
)
from multiprocess import run_ranks


@dataclass(frozen=True)
class EbcCase:
    """One equivalence case: a plan kind trained for `steps` steps, sharded vs unsharded."""

    local_world_size: int  # ranks per "node" (table-row/column-wise stay inside one)
    kind: str  # a plan kind of `ebc_cases.plan_for`
    kernel: str  # "fused" or "dense"
    optimizer: str  # fused optimizer: "sgd" or "rowwise_adagrad"
    weighted: bool
    batch_size: int  # per rank
    steps: int
    threads: int = 1  # > 1: fused groups cut into kernels that run side by side
    shared: bool = False  # `ebc_cases.tables(shared=True)`: features read by several tables

    @property
    def name(self) -> str:
        return (
            f"{self.kind}/{self.kernel}/{self.optimizer}/lws{self.local_world_size}/"
            f"{'weighted' if self.weighted else 'unweighted'}/batch{self.batch_size}/"
            f"steps{self.steps}/threads{self.threads}{'/shared' if self.shared else ''}"
        )


def run_case(rank: int, ws: int, case: EbcCase) -> List[str]:
    """Returns a list of mismatch descriptions (empty when everything matches).

    `case.threads` > 1: the sharded module is built and run with that many torch threads, so
    its fbgemm groups are cut into kernels that run side by side (`recshard.lookup.threads`).
    """
    torch.set_num_threads(case.threads)
    try:
        return _compare(rank, ws, case)
    finally:
        torch.set_num_threads(1)


def _compare(rank: int, ws: int, case: EbcCase) -> List[str]:
    problems: List[str] = []
    lws, kind, kernel, optimizer = case.local_world_size, case.kind, case.kernel, case.optimizer
    weighted, batch_size, steps, shared = case.weighted, case.batch_size, case.steps, case.shared
    reference = make_ebc(weighted, shared=shared)
    plan, sharded, dense_opt = shard_reference(reference, kind, ws, lws, kernel, optimizer, shared)
    state: Dict[str, Dict[str, torch.Tensor]] = {}
    for step in range(steps):
        zero = step == 1
        local = batch(rank, step, batch_size, weighted, zero, shared)
        out = sharded(local)
        ref_out = reference(global_batch(ws, step, batch_size, weighted, zero, shared))
        width = ref_out.values().size(1)
        grad = output_grad(step, ws, batch_size, width)
        mine = slice(rank * batch_size, (rank + 1) * batch_size)
        if out.keys() != ref_out.keys():
            problems.append(f"step {step}: keys {out.keys()} != {ref_out.keys()}")
        if not torch.allclose(out.values(), ref_out.values()[mine], atol=1e-5):
            problems.append(
                f"step {step}: forward differs by "
                f"{(out.values() - ref_out.values()[mine]).abs().max():.3g}"
            )
        (out.values() * grad[mine]).sum().backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
        reference.zero_grad()
        # mean over ranks of per-rank gradients == gradient of the global loss / ws
        ((ref_out.values() * grad).sum() / ws).backward()
        problems += step_reference_and_compare(
            sharded,
            reference,
            plan,
            kind,
            kernel,
            optimizer,
            state,
            ws,
            step,
            compare=step in (0, steps - 1),
        )
    return problems


def run_all(rank: int, ws: int, cases: List[EbcCase]) -> Dict[str, List[str]]:
    results = {}
    for case in cases:
        try:
            results[case.name] = run_case(rank, ws, case)
        except Exception as e:  # report per case, keep the group going
            results[case.name] = [f"raised {type(e).__name__}: {e}\n{traceback.format_exc()}"]
    return results


def cases_for(ws: int) -> List[EbcCase]:
    lws = ws if ws < 4 else 2  # ws 4: two "nodes" of two ranks
    cases = []
    for kind in KINDS:
        for optimizer in ("sgd", "rowwise_adagrad"):
            cases.append(
                EbcCase(lws, kind, "fused", optimizer, weighted=False, batch_size=3, steps=3)
            )
        cases.append(EbcCase(lws, kind, "dense", "sgd", weighted=False, batch_size=3, steps=2))
    cases += [
        EbcCase(lws, "mixed", "fused", "sgd", weighted=True, batch_size=3, steps=2),
        EbcCase(lws, "row_wise", "fused", "sgd", weighted=False, batch_size=1, steps=2),
        EbcCase(lws, "table_row_wise", "fused", "sgd", weighted=True, batch_size=2, steps=2),
    ]
    if ws <= 2:  # fbgemm kernels side by side on two threads
        for kind in ("table_wise", "row_wise", "mixed"):
            cases.append(
                EbcCase(
                    lws,
                    kind,
                    "fused",
                    "rowwise_adagrad",
                    weighted=kind == "mixed",
                    batch_size=3,
                    steps=3,
                    threads=2,
                )
            )
    for kind in KINDS:  # features read by several tables
        cases.append(
            EbcCase(
                lws,
                kind,
                "fused",
                "rowwise_adagrad",
                weighted=True,
                batch_size=3,
                steps=2,
                shared=True,
            )
        )
    cases += [
        EbcCase(lws, "mixed", "fused", "sgd", weighted=False, batch_size=2, steps=3, shared=True),
        EbcCase(lws, "mixed", "dense", "sgd", weighted=True, batch_size=3, steps=2, shared=True),
    ]
    if ws == 2:  # two nodes of one rank each
        cases += [
            EbcCase(1, "table_row_wise", "fused", "sgd", weighted=False, batch_size=2, steps=2),
            EbcCase(1, "mixed", "fused", "rowwise_adagrad", weighted=False, batch_size=2, steps=2),
        ]
    return cases


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow), 4])
def test_sharded_ebc_equals_unsharded(world_size: int) -> None:
    cases = cases_for(world_size)
    results = run_ranks(world_size, run_all, cases, timeout=600)
    failures = {case: problems for case, problems in results[0].items() if problems}
    for rank_results in results[1:]:
        for case, problems in rank_results.items():
            if problems and case not in failures:
                failures[case] = problems
    assert not failures, "\n".join(f"{c}: {p}" for c, p in failures.items())
