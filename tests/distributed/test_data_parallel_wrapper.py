"""DefaultDataParallelWrapper's TorchRec arguments, across 2 real processes (gloo).

Each rank's dense layers get their own gradient (their own slice of the batch); DDP's
gradient is then compared with the ranks' local gradients: the fp32 mean by default, the
parameters in `params_to_ignore` left local, the mean as torch's bf16 / fp16 compress hook
forms it under `allreduce_comm_precision`; `ddp_kwargs` reach DDP (`init_sync=False`: the
ranks' differently initialized parameters are not made equal at wrap time).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch
from dmp_cases import TinyDLRM, batch_for, tables
from multiprocess import run_ranks
from torch import nn

from recshard import EmbeddingBagCollection, KeyedJaggedTensor
from recshard.distributed import (
    DefaultDataParallelWrapper,
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
)
from recshard.distributed.model_parallel import get_unwrapped_module
from recshard.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recshard.types import ShardingEnv, ShardingPlan

DENSE = ["dense.weight", "dense.bias", "extra.weight", "extra.bias"]


class TwoDense(nn.Module):
    """A sharded EBC and two dense layers, each with its own squared-output loss term."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables())
        self.dense = nn.Linear(3, 4)
        self.extra = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(features).values().sum() + dense_loss(self, x)


def dense_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model.dense(x) ** 2).sum() + (model.extra(x) ** 2).sum()


def wrapped_step(rank: int, ws: int, wrapper: Dict[str, Any]) -> Dict[str, Any]:
    """DMP with `DefaultDataParallelWrapper(**wrapper)`, one backward: each dense tensor's
    value, local gradient (this rank's batch alone) and gradient after DDP."""
    torch.manual_seed(rank)  # the ranks' dense layers start different
    per_table = {t: table_wise(i % ws) for i, t in enumerate(["ta", "tb", "tc"])}
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(TinyDLRM("meta").ebc, per_table, world_size=ws)}
    )
    try:
        model = DistributedModelParallel(
            TwoDense(),
            env=ShardingEnv.from_process_group(torch.distributed.group.WORLD),
            device=torch.device("cpu"),
            plan=plan,
            sharders=[EmbeddingBagCollectionSharder()],
            data_parallel_wrapper=DefaultDataParallelWrapper(**wrapper),
        )
    except ValueError as e:
        return {"error": str(e)}
    x, features, _ = batch_for(0, rank, ws)
    unwrapped = get_unwrapped_module(model)
    local = nn.ModuleDict({n: copy.deepcopy(getattr(unwrapped, n)) for n in ("dense", "extra")})
    dense_loss(local, x).backward()
    model(x, features).backward()
    params = dict(get_unwrapped_module(model).named_parameters())
    local_params = dict(local.named_parameters())
    return {
        name: [
            t.tolist() for t in (params[name].detach(), local_params[name].grad, params[name].grad)
        ]
        for name in DENSE
    }


def run_cases(rank: int, ws: int, cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    return {name: wrapped_step(rank, ws, wrapper) for name, wrapper in cases.items()}


CASES: Dict[str, Dict[str, Any]] = {
    "default": {},
    "ignore extra": {"params_to_ignore": ["extra.weight", "extra.bias"]},
    "bf16": {"allreduce_comm_precision": "bf16"},
    "fp16": {"allreduce_comm_precision": "fp16"},
    "no init sync": {"ddp_kwargs": {"init_sync": False}},
    "misspelt ignore": {"params_to_ignore": ["extra.wieght"]},
}


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    """By rank and case: {name: (value, local gradient, gradient after DDP)}, or the error
    (tensors travel as lists: a tensor put on the queue dies with its process)."""
    return [
        {
            case: {
                n: tuple(torch.tensor(t) for t in v) if n != "error" else v for n, v in r.items()
            }
            for case, r in by_case.items()
        }
        for by_case in run_ranks(2, run_cases, CASES, timeout=180)
    ]


def _mean(results: List[Dict[str, Any]], case: str, name: str) -> torch.Tensor:
    return (results[0][case][name][1] + results[1][case][name][1]) / 2


def test_default_averages_every_dense_gradient(results: List[Dict[str, Any]]) -> None:
    for name in DENSE:
        for rank in range(2):
            value, local, reduced = results[rank]["default"][name]
            torch.testing.assert_close(reduced, _mean(results, "default", name))
            torch.testing.assert_close(value, results[0]["default"][name][0])  # synced at wrap
        assert not torch.equal(results[0]["default"][name][1], results[1]["default"][name][1])


def test_params_to_ignore_are_not_averaged(results: List[Dict[str, Any]]) -> None:
    for rank in range(2):
        for name in DENSE:
            value, local, reduced = results[rank]["ignore extra"][name]
            if name.startswith("extra"):  # this rank's own gradient, its own initial values
                assert torch.equal(reduced, local), name
                assert not torch.equal(value, results[1 - rank]["ignore extra"][name][0])
            else:
                torch.testing.assert_close(reduced, _mean(results, "ignore extra", name))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_allreduce_comm_precision_reduces_in_that_dtype(
    results: List[Dict[str, Any]], precision: str
) -> None:
    """As torch's compress hook: each rank's gradient in the dtype, divided by the world
    size, summed in the dtype, widened back: exactly, and unlike the fp32 mean."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    differs = False
    for name in DENSE:
        locals_ = [results[rank][precision][name][1] for rank in range(2)]
        expected = sum(g.to(dtype) / 2 for g in locals_).float()
        for rank in range(2):
            assert torch.equal(results[rank][precision][name][2], expected), (precision, name)
        differs |= not torch.equal(expected, sum(locals_) / 2)
    assert differs


def test_ddp_kwargs_reach_ddp(results: List[Dict[str, Any]]) -> None:
    """`init_sync=False`: the ranks keep their own initial dense values (the default syncs
    them from rank 0 at wrap time)."""
    for name in DENSE:
        assert not torch.equal(
            results[0]["no init sync"][name][0], results[1]["no init sync"][name][0]
        )


def test_a_misspelt_ignored_name_is_refused_on_every_rank(results: List[Dict[str, Any]]) -> None:
    for rank in range(2):
        assert (
            "params_to_ignore names ['extra.wieght']" in results[rank]["misspelt ignore"]["error"]
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"allreduce_comm_precision": "fp8"}, r"allreduce_comm_precision must be one of"),
        ({"ddp_kwargs": {"bucket_cap_mb": 1}}, r"ddp_kwargs \['bucket_cap_mb'\] are set by"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DefaultDataParallelWrapper(**kwargs)
