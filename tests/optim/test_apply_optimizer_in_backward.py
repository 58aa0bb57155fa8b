"""`apply_optimizer_in_backward` is honoured by sharded fused tables, whatever the sharder's
`fused_params` say, and a data-parallel (dense-kernel) table is left to the dense optimizer as
in TorchRec: two steps of a sharded model equal two steps of the unsharded module with the
same torch optimizer. Optimizers the kernels cannot run fail on every rank, naming
the table."""

from __future__ import annotations

from typing import Any, Dict, List, Type

import pytest
import torch
from torch import nn

from recshard import ShardingPlan
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.optim import (
    KeyedOptimizerWrapper,
    RowWiseAdagrad,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)
from tests.distributed.ebc_cases import batch, gather_tables, global_batch, make_ebc, output_grad
from tests.multiprocess import run_ranks

B = 3
WIDTH = 4 + 4 + 3 + 6 + 1 + 8  # f0, f1 (t0), f2 (t1), f3 (t2), f4 (t3), f5 (t4)


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = make_ebc(weighted=False)

    def forward(self, features: Any) -> torch.Tensor:
        return self.ebc(features).values()


def _plan(column: bool) -> Dict[str, Any]:
    """Every sharding type; fbgemm (dims 4, 8) and torch (dims 3, 6, 1) kernels. Row-wise
    Adagrad keeps one accumulator per column shard, so its case has no column-wise table."""
    return {
        "t0": table_wise(rank=1),
        "t1": row_wise(),
        "t2": data_parallel(),
        "t3": table_wise(rank=0),
        "t4": column_wise(ranks=[0, 1]) if column else row_wise(),
    }


def _sharded_steps(
    rank: int,
    ws: int,
    cls: Type[torch.optim.Optimizer],
    kwargs: Dict[str, Any],
    column: bool,
    steps: int,
) -> Dict[str, List[List[float]]]:
    model = Wrapper()
    apply_optimizer_in_backward(cls, model.ebc.parameters(), kwargs)
    # the sharder says exact SGD at lr 0.5: the attached optimizer must win
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.5}
    )
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(model.ebc, _plan(column), world_size=ws)}
    )
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    # as in TorchRec, the data-parallel (dense-kernel) table t2 is left to the dense optimizer
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    assert list(dense) == ["ebc.embedding_bags.t2.weight"], list(dense)
    optimizer = KeyedOptimizerWrapper(dense, lambda params: cls(params, **kwargs))
    for step in range(steps):
        optimizer.zero_grad()
        out = dmp(batch(rank, step, B, False, False))
        (out * output_grad(step, ws, B, WIDTH)[rank * B : (rank + 1) * B]).sum().backward()
        optimizer.step()
    return {name: weight.tolist() for name, weight in gather_tables(dmp.module.ebc, ws).items()}


def _reference_steps(
    ws: int, cls: Type[torch.optim.Optimizer], kwargs: Dict[str, Any], steps: int
) -> Dict[str, torch.Tensor]:
    ebc = make_ebc(weighted=False)
    optimizer = cls(ebc.parameters(), **kwargs)
    for step in range(steps):
        optimizer.zero_grad()
        out = ebc(global_batch(ws, step, B, False, False)).values()
        ((out * output_grad(step, ws, B, WIDTH)).sum() / ws).backward()  # mean over ranks
        optimizer.step()
    return {name: bag.weight.detach() for name, bag in ebc.embedding_bags.items()}


CASES = [
    (torch.optim.SGD, {"lr": 0.1}, True),
    (torch.optim.Adagrad, {"lr": 0.1}, True),
    (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-6}, True),
    (RowWiseAdagrad, {"lr": 0.1}, False),
]


@pytest.mark.parametrize(
    "cls,kwargs,column", CASES, ids=["sgd", "adagrad", "adagrad-eps", "rowwise"]
)
def test_attached_optimizer_matches_unsharded(
    cls: Type[torch.optim.Optimizer], kwargs: Dict[str, Any], column: bool
) -> None:
    steps = 2
    results = run_ranks(2, _sharded_steps, cls, kwargs, column, steps, timeout=300)
    expected = _reference_steps(2, cls, kwargs, steps)
    start = make_ebc(weighted=False)
    for name, weight in expected.items():
        assert not torch.equal(weight, start.embedding_bags[name].weight), name  # it did train
        for rank, tables in enumerate(results):
            torch.testing.assert_close(
                torch.tensor(tables[name]),
                weight,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name, r=rank: f"table {n} rank {r}: {m}",
            )


def _shard_error(
    rank: int, ws: int, cls: Type[torch.optim.Optimizer], kwargs: Dict[str, Any], table: str
) -> str | None:
    model = Wrapper()
    apply_optimizer_in_backward(cls, [model.ebc.embedding_bags[table].weight], kwargs)
    per_table = {
        "t0": table_wise(rank=1),
        "t1": table_wise(rank=1),
        "t2": table_wise(rank=1),
        "t3": table_wise(rank=1),
        "t4": table_wise(rank=1),
    }
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(model.ebc, per_table, world_size=ws)}
    )
    try:
        DistributedModelParallel(model, plan=plan)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "cls,kwargs,words",
    [
        (torch.optim.Adam, {"lr": 0.1}, "ADAM"),  # fbgemm's CPU kernel has no Adam
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum=0.9"),
        (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01}, "weight_decay=0.01"),
        (torch.optim.RMSprop, {"lr": 0.1}, "RMSprop"),
    ],
    ids=["adam-cpu", "sgd-momentum", "adagrad-weight-decay", "rmsprop"],
)
def test_optimizer_the_kernel_cannot_run_fails_on_every_rank(
    cls: Type[torch.optim.Optimizer], kwargs: Dict[str, Any], words: str
) -> None:
    # the table lives on rank 1 only: rank 0 must refuse too, or rank 1 waits for it
    messages: List[str | None] = run_ranks(2, _shard_error, cls, kwargs, "t4", timeout=120)
    for message in messages:
        assert message is not None and "table 't4'" in message and words in message, message
