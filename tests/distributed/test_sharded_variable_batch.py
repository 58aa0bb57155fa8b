"""Sharded EBC == unsharded EBC on variable-batch (VBE) input: each rank's features pooled at
their own batch sizes and expanded by `inverse_indices`, for every sharding type and a mixed
plan, fused (SGD, row-wise Adagrad) and dense kernels, weighted and unweighted, at world sizes
1-3 (and two one-rank "nodes" for table-row-wise across nodes). Forward values and keys,
gradients (through the tables after a step), tables and fused optimizer state after 1 and 2
steps. Batch shapes: one-row user features beside full item features, batch sizes that differ
per feature and per rank, a feature with no ids, and a rank sending an ordinary batch.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass
from typing import Dict, List, Tuple

import pytest
import torch
from ebc_cases import (
    KINDS,
    LR,
    make_ebc,
    plan_for,
    shard_reference,
    step_reference_and_compare,
)
from ebc_cases import tables as ebc_tables
from multiprocess import run_ranks
from vbe_cases import Drawn, vbe_batch

from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan
from recshard.types import ShardingEnv


@dataclass(frozen=True)
class VbeCase:
    local_world_size: int
    kind: str
    kernel: str  # "fused" or "dense"
    optimizer: str  # fused: "sgd" or "rowwise_adagrad"
    weighted: bool
    shape: str  # a `vbe_cases.feature_batches` shape
    steps: int = 2
    shared: bool = False
    drawn: Tuple[Tuple[Drawn, ...], ...] = ()  # per step, per rank: sizes instead of `shape`

    @property
    def name(self) -> str:
        return (
            f"{self.kind}/{self.kernel}/{self.optimizer}/lws{self.local_world_size}/"
            f"{'weighted' if self.weighted else 'unweighted'}/{self.shape}"
            f"{'/shared' if self.shared else ''}{f'/{self.drawn}' if self.drawn else ''}"
        )


def output_grad(rank: int, step: int, rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(77 + 10 * step + rank))


def compare(rank: int, ws: int, case: VbeCase) -> List[str]:
    problems: List[str] = []
    lws, kind, kernel = case.local_world_size, case.kind, case.kernel
    reference = make_ebc(case.weighted, shared=case.shared)
    tables = ebc_tables(case.shared)
    plan, sharded, dense_opt = shard_reference(
        reference, kind, ws, lws, kernel, case.optimizer, case.shared
    )
    state: Dict[str, Dict[str, torch.Tensor]] = {}
    for step in range(case.steps):
        batches = [
            vbe_batch(
                r,
                step,
                case.shape,
                case.weighted,
                tables,
                case.drawn[step][r] if case.drawn else None,
            )
            for r in range(ws)
        ]
        out = sharded(batches[rank])
        reference.zero_grad()
        ref_outs = [reference(b) for b in batches]
        grads = [
            output_grad(r, step, ref.values().size(0), ref.values().size(1))
            for r, ref in enumerate(ref_outs)
        ]
        ref_out = ref_outs[rank]
        if out.keys() != ref_out.keys():
            problems.append(f"step {step}: keys {out.keys()} != {ref_out.keys()}")
        if out.values().shape != ref_out.values().shape:
            problems.append(
                f"step {step}: shape {tuple(out.values().shape)} != {tuple(ref_out.values().shape)}"
            )
            return problems
        if not torch.allclose(out.values(), ref_out.values(), atol=1e-5):
            problems.append(
                f"step {step}: forward differs by "
                f"{(out.values() - ref_out.values()).abs().max():.3g}"
            )
        (out.values() * grads[rank]).sum().backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
        # the mean over ranks of each rank's gradient
        (sum((r.values() * g).sum() for r, g in zip(ref_outs, grads)) / ws).backward()
        problems += step_reference_and_compare(
            sharded, reference, plan, kind, kernel, case.optimizer, state, ws, step
        )
    return problems


def run_all(rank: int, ws: int, cases: List[VbeCase]) -> Dict[str, List[str]]:
    results = {}
    for case in cases:
        try:
            results[case.name] = compare(rank, ws, case)
        except Exception as e:  # report per case, keep the group going
            results[case.name] = [f"raised {type(e).__name__}: {e}\n{traceback.format_exc()}"]
    return results


def cases_for(ws: int) -> List[VbeCase]:
    cases = []
    for kind in KINDS:
        cases.append(VbeCase(ws, kind, "fused", "rowwise_adagrad", False, "user_item"))
        cases.append(VbeCase(ws, kind, "fused", "sgd", True, "per_rank"))
        cases.append(VbeCase(ws, kind, "dense", "sgd", False, "empty"))
    cases += [
        VbeCase(ws, "mixed", "fused", "sgd", False, "rank0_fixed"),
        VbeCase(ws, "mixed", "fused", "rowwise_adagrad", True, "per_rank", shared=True),
        VbeCase(ws, "mixed", "dense", "sgd", True, "user_item", shared=True),
    ]
    if ws == 2:  # two nodes of one rank: table-row-wise reduces, then exchanges across nodes
        cases += [
            VbeCase(1, "table_row_wise", "fused", "sgd", True, "per_rank"),
            VbeCase(1, "mixed", "fused", "rowwise_adagrad", False, "user_item"),
        ]
    return cases


def check(results: List[Dict[str, List[str]]]) -> None:
    failures: Dict[str, List[str]] = {}
    for rank_results in results:
        for case, problems in rank_results.items():
            if problems and case not in failures:
                failures[case] = problems
    assert not failures, "\n".join(f"{c}: {p}" for c, p in failures.items())


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_sharded_ebc_equals_unsharded_on_variable_batch(world_size: int) -> None:
    check(run_ranks(world_size, run_all, cases_for(world_size), timeout=600))


def feature_processed(rank: int, ws: int) -> List[str]:
    """The sharded FeatureProcessedEmbeddingBagCollection (position weights) on VBE input:
    forward equals the unsharded module's, and the position weights' gradients averaged over
    ranks (DMP's DDP does it) equal the gradient of the mean loss."""
    from fp_cases import make_fp_ebc

    from recshard.distributed.fp_embeddingbag import (
        FeatureProcessedEmbeddingBagCollectionSharder,
    )

    problems = []
    batches = [vbe_batch(r, 0, "per_rank", False, ebc_tables()) for r in range(ws)]
    for kind in ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"]:
        reference = make_fp_ebc("collection")
        sharder = FeatureProcessedEmbeddingBagCollectionSharder(
            EmbeddingBagCollectionSharder({"optimizer": "exact_sgd", "learning_rate": LR})
        )
        plan = construct_module_sharding_plan(
            reference, plan_for(kind, ws, ws, "fused"), sharder=sharder, world_size=ws
        )
        env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
        sharded = sharder.shard(copy.deepcopy(reference), plan, env)
        out = sharded(batches[rank]).values()
        refs = [reference(b).values() for b in batches]
        if not torch.allclose(out, refs[rank], atol=1e-5):
            problems.append(f"{kind}: forward differs")
        out.sum().backward()
        (sum(r.sum() for r in refs) / ws).backward()
        want = {n: p.grad for n, p in reference.named_parameters() if "position" in n}
        got = {n: p.grad for n, p in sharded.named_parameters() if "position" in n}
        if sorted(got) != sorted(want) or not want:
            problems.append(f"{kind}: position weights {sorted(got)} != {sorted(want)}")
            continue
        for name, grad in got.items():
            torch.distributed.all_reduce(grad)
            if not torch.allclose(grad / ws, want[name], atol=1e-5):
                problems.append(f"{kind}: gradient of {name} differs")
    return problems


def test_sharded_feature_processed_ebc_on_variable_batch() -> None:
    assert run_ranks(2, feature_processed, timeout=300) == [[], []]
