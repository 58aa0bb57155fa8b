"""A plain `nn.EmbeddingBag` sharded inside DMP by `EmbeddingBagSharder` equals the unsharded
bag: the same `[B, D]` outputs and, after two optimizer steps, the same weights (gradient
convention: the mean over ranks), for data-parallel, table-, row- and column-wise plans and
the bag's input forms (1-D with offsets, `include_last_offset`, 2-D; per-sample weights;
`padding_idx`; 'sum' and 'mean'). Its state is named as the bag's (`bag.weight`); a bad
batch on one rank stops every rank; options the kernels do not run are refused."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import pytest
import torch
from dmp_cases import LR
from ebc_cases import gather_tables
from multiprocess import run_ranks
from torch import nn

from recshard.distributed import DistributedModelParallel, EmbeddingBagSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter
from recshard.types import ShardingPlan

ROWS, DIM, BAGS = 13, 6, 4  # bags per rank
CASES: Dict[str, Dict[str, Any]] = {  # nn.EmbeddingBag options, and the input form
    "sum_1d_weighted": {"bag": {"mode": "sum"}, "form": "1d", "weighted": True},
    "sum_2d_padding": {"bag": {"mode": "sum", "padding_idx": 3}, "form": "2d"},
    "mean_last_offset_padding": {
        "bag": {"mode": "mean", "include_last_offset": True, "padding_idx": 0},
        "form": "1d",
    },
}


class Model(nn.Module):
    def __init__(self, **bag: Any) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, **bag)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.bag(*args, **kwargs)


def inputs(case: str, step: int, rank: int) -> Tuple[tuple, dict]:
    """Rank `rank`'s `bag(...)` arguments at `step` (empty bags included)."""
    spec = CASES[case]
    g = torch.Generator().manual_seed(100 * step + rank)
    if spec["form"] == "2d":
        return (torch.randint(0, ROWS, (BAGS, 3), generator=g),), {}
    lengths = torch.randint(0, 4, (BAGS,), generator=g)
    lengths[rank % BAGS] = 0
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    if not spec["bag"].get("include_last_offset"):
        offsets = offsets[:-1]
    kwargs = (
        {"per_sample_weights": torch.rand(ids.numel(), generator=g)} if "weighted" in spec else {}
    )
    return (ids, offsets), kwargs


def output_grad(step: int, rank: int) -> torch.Tensor:
    return torch.randn(BAGS, DIM, generator=torch.Generator().manual_seed(7 + 10 * step + rank))


def plan(kind: str, ws: int) -> ShardingPlan:
    helper = {
        "data_parallel": data_parallel(),
        "table_wise": table_wise(rank=ws - 1),
        "row_wise": row_wise(),
        "column_wise": column_wise(ranks=list(range(ws))),
    }[kind]
    bag = nn.EmbeddingBag(ROWS, DIM, device="meta")
    per_param = construct_module_sharding_plan(
        bag, {"weight": helper}, sharder=EmbeddingBagSharder(), world_size=ws
    )
    return ShardingPlan({"bag": per_param})


def optimizer(dmp: DistributedModelParallel) -> CombinedOptimizer:
    """The fused tables' SGD, and SGD on a data-parallel table's weight."""
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    parts: List[Any] = [dmp.fused_optimizer]
    if dense:
        parts.append(KeyedOptimizerWrapper(dense, lambda p: torch.optim.SGD(p, lr=LR)))
    return CombinedOptimizer(parts)


def equivalence(rank: int, ws: int) -> List[str]:
    problems = []
    sharder = EmbeddingBagSharder(fused_params={"optimizer": "exact_sgd", "learning_rate": LR})
    for case, spec in CASES.items():
        for kind in ["data_parallel", "table_wise", "row_wise", "column_wise"]:
            torch.manual_seed(0)
            reference = Model(**spec["bag"])
            dmp = DistributedModelParallel(
                copy.deepcopy(reference), plan=plan(kind, ws), sharders=[sharder]
            )
            opt = optimizer(dmp)
            where = f"{case}/{kind}"
            for step in range(2):
                args, kwargs = inputs(case, step, rank)
                got = dmp(*args, **kwargs)
                want = reference(*args, **kwargs)
                if not torch.allclose(got, want, atol=1e-6):
                    problems.append(f"{where} step {step}: output {got} != {want}")
                opt.zero_grad()
                (got * output_grad(step, rank)).sum().backward()
                opt.step()
                reference.zero_grad()
                total = sum(
                    (reference(*a, **k) * output_grad(step, r)).sum()
                    for r in range(ws)
                    for a, k in [inputs(case, step, r)]
                )
                (total / ws).backward()
                with torch.no_grad():
                    reference.bag.weight -= LR * reference.bag.weight.grad
            weight = gather_tables(dmp.module.bag, ws)["weight"]
            if not torch.allclose(weight, reference.bag.weight, atol=1e-6):
                problems.append(f"{where}: weights after 2 steps differ")
            if list(dmp.state_dict()) != ["bag.weight"]:
                problems.append(f"{where}: state_dict keys {list(dmp.state_dict())}")
            holds = kind != "data_parallel" and (kind != "table_wise" or rank == ws - 1)
            fused = list(dmp.fused_optimizer.params)
            if fused != (["bag.weight"] if holds else []):
                problems.append(f"{where}: fused optimizer params {fused}")
    return problems


@pytest.mark.parametrize("world_size", [1, 3])
def test_sharded_embedding_bag_equals_the_unsharded_bag(world_size: int) -> None:
    for problems in run_ranks(world_size, equivalence, timeout=300):
        assert problems == []


def planned_and_checked(rank: int, ws: int) -> Dict[str, str]:
    """No plan: the planner plans the bag. Then one rank's bad offsets stop every rank, and
    options the kernels do not run are refused."""
    torch.manual_seed(0)
    reference = Model(mode="sum")
    dmp = DistributedModelParallel(copy.deepcopy(reference), sharders=[EmbeddingBagSharder()])
    args, _ = inputs("sum_2d_padding", 0, rank)
    torch.testing.assert_close(dmp(*args).wait(), reference(*args))
    out = {"plan": dmp.plan.get_plan_for_module("bag")["weight"].sharding_type}
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([1 if rank == 0 else 0, 2])
    with pytest.raises((ValueError, RuntimeError)) as bad:  # the others: "rank 0 rejected"
        dmp(ids, offsets)
    out["bad offsets"] = str(bad.value)
    for options in [{"mode": "max"}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}]:
        with pytest.raises(ValueError) as refused:
            DistributedModelParallel(
                Model(**options), plan=plan("row_wise", ws), sharders=[EmbeddingBagSharder()]
            )
        out[str(options)] = str(refused.value)
    return out


def test_planned_bad_input_and_refused_options() -> None:
    results = run_ranks(2, planned_and_checked, timeout=180)
    for result in results:
        assert result["plan"] in {"data_parallel", "table_wise", "row_wise", "column_wise"}
        assert "offsets must start at 0, got [1, 2]" in result["bad offsets"]
        assert "mode='max'" in result["{'mode': 'max'}"]
        assert "max_norm=1.0" in result["{'max_norm': 1.0}"]
        assert "scale_grad_by_freq" in result["{'scale_grad_by_freq': True}"]
    assert "rank 0" in results[1]["bad offsets"]  # rank 1's batch was fine: told by rank 0
