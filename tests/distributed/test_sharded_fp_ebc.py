"""ShardedFeatureProcessedEmbeddingBagCollection through DistributedModelParallel equals the
unsharded FeatureProcessedEmbeddingBagCollection on the global batch: forward outputs, the
position weights' gradients (after DDP), and tables and position weights after an optimizer
step (SGD; fused kernels update in backward, dense ones with the dense optimizer), for every
sharding type at world sizes 1-3, fused and dense kernels, processors as a collection or a
dict. One process group per world size runs every case."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch
from ebc_cases import (
    KINDS,
    LR,
    batch,
    gather_tables,
    global_batch,
    output_grad,
)
from fp_cases import make_fp_ebc, sharded_model
from multiprocess import run_ranks

from recshard.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from recshard.distributed.model_parallel import DefaultDataParallelWrapper
from recshard.optim import in_backward_optimizer_filter


@dataclass(frozen=True)
class FpCase:
    kind: str  # a plan kind of `ebc_cases.plan_for`
    kernel: str  # "fused" or "dense"
    processors: str  # a kind of `fp_cases.make_fp_ebc`
    batch_size: int = 3
    steps: int = 2

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.kernel}/{self.processors}"


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def run_case(rank: int, ws: int, case: FpCase) -> List[str]:
    """Mismatch descriptions (empty when the sharded model matches the reference)."""
    problems: List[str] = []
    reference = make_fp_ebc(case.processors)
    model = sharded_model(reference, case.kind, case.kernel, ws)
    sharded = model.module.fp
    assert isinstance(sharded, ShardedFeatureProcessedEmbeddingBagCollection)
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    if not any(name.startswith("fp._feature_processors.") for name in dense):
        problems.append(f"processor parameters missing from the dense parameters: {list(dense)}")
    dense_opt = torch.optim.SGD(list(dense.values()), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_processors = dict(reference._feature_processors.named_parameters())
    for step in range(case.steps):
        zero = step == 1  # f3 has no ids at all
        out = model(batch(rank, step, case.batch_size, False, zero))
        ref_out = reference(global_batch(ws, step, case.batch_size, False, zero))
        mine = slice(rank * case.batch_size, (rank + 1) * case.batch_size)
        if not _close(out.values(), ref_out.values()[mine]):
            problems.append(f"step {step}: forward differs")
        grad = output_grad(step, ws, case.batch_size, ref_out.values().size(1))
        dense_opt.zero_grad()
        ref_opt.zero_grad()
        (out.values() * grad[mine]).sum().backward()
        ((ref_out.values() * grad).sum() / ws).backward()  # mean over ranks of local losses
        for name, p in sharded._feature_processors.named_parameters():
            expected = ref_processors[name].grad
            if p.grad is None or not _close(p.grad, expected):
                problems.append(f"step {step}: gradient of {name}: {p.grad} != {expected}")
        dense_opt.step()
        ref_opt.step()
        for name, p in sharded._feature_processors.named_parameters():
            if not _close(p.detach(), ref_processors[name].detach()):
                problems.append(f"step {step}: {name} after the step differs")
        full = gather_tables(sharded._embedding_bag_collection, ws)
        for name, bag in reference._embedding_bag_collection.embedding_bags.items():
            if not _close(full[name], bag.weight.detach()):
                problems.append(f"step {step}: table {name} after the step differs")
    return problems


def run_all(rank: int, ws: int, cases: List[FpCase]) -> Dict[str, List[str]]:
    results = {}
    for case in cases:
        try:
            results[case.name] = run_case(rank, ws, case)
        except Exception as e:  # report per case, keep the group going
            results[case.name] = [f"raised {type(e).__name__}: {e}\n{traceback.format_exc()}"]
    return results


def cases() -> List[FpCase]:
    out = [FpCase(kind, "fused", "collection") for kind in KINDS]
    out += [FpCase(kind, "dense", "dict") for kind in KINDS]
    out += [
        FpCase(kind, "fused", "custom")
        for kind in ("table_wise", "column_wise", "table_column_wise", "data_parallel")
    ]
    return out


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_sharded_fp_ebc_equals_unsharded(world_size: int) -> None:
    results = run_ranks(world_size, run_all, cases(), timeout=600)
    failures = {}
    for rank, rank_results in enumerate(results):
        for case, problems in rank_results.items():
            if problems and case not in failures:
                failures[case] = [f"rank {rank}: {p}" for p in problems]
    assert not failures, "\n".join(f"{c}: {p}" for c, p in failures.items())


def _static_graph(rank: int, ws: int) -> str:
    wrapper = DefaultDataParallelWrapper(static_graph=True)
    try:
        sharded_model(make_fp_ebc("collection"), "table_wise", "fused", ws, wrapper=wrapper)
    except ValueError as e:
        return str(e)
    return "built"


def test_static_graph_with_feature_processors_is_refused_on_every_rank() -> None:
    """DDP's static graph gave the position weights wrong gradients (world size times the
    unsharded ones, or zeros): refused, naming the module, before DDP's first collective."""
    for message in run_ranks(2, _static_graph, timeout=120):
        assert "static_graph=True" in message and "'fp'" in message, message
