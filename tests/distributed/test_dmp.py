"""DistributedModelParallel training equals single-process training; checkpoints reshard
(also between ranks that cut their fused groups into per-thread kernels and ranks that do not).

Reference: the same model, unsharded, trained in one process on the concatenated global
batches with the same optimizers (gradient convention: mean over ranks).
"""

from __future__ import annotations

import copy
import tempfile
from typing import Dict, List

import pytest
import torch
from dmp_cases import TinyDLRM, batch_for, make_optimizer, train
from multiprocess import run_ranks

from recshard import checkpoint
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.types import ShardingPlan

STEPS = 4


def plan(kind: str, ws: int, kernel: str) -> ShardingPlan:
    k = None if kernel == "fused" else "dense"
    per_table = {
        "table_wise": {
            t: table_wise(i % ws, compute_kernel=k) for i, t in enumerate(["ta", "tb", "tc"])
        },
        "row_wise": {t: row_wise(compute_kernel=k) for t in ["ta", "tb", "tc"]},
        "column_wise": {
            t: column_wise(list(range(ws)), compute_kernel=k) for t in ["ta", "tb", "tc"]
        },
        "mixed": {
            "ta": table_wise(ws - 1, compute_kernel=k),
            "tb": row_wise(compute_kernel=k),
            "tc": data_parallel(),
        },
    }[kind]
    module_plan = construct_module_sharding_plan(TinyDLRM("meta").ebc, per_table, world_size=ws)
    return ShardingPlan({"ebc": module_plan})


def sharders(adagrad: bool) -> list:
    optim = "exact_adagrad" if adagrad else "exact_sgd"
    return [EmbeddingBagCollectionSharder(fused_params={"optimizer": optim, "learning_rate": 0.05})]


def build(kind: str, ws: int, kernel: str, adagrad: bool) -> DistributedModelParallel:
    torch.manual_seed(0)
    return DistributedModelParallel(
        TinyDLRM(), plan=plan(kind, ws, kernel), sharders=sharders(adagrad)
    )


def equivalence(rank: int, ws: int) -> Dict[str, List[str]]:
    problems: Dict[str, List[str]] = {}
    for kind in ["table_wise", "row_wise", "column_wise", "mixed"]:
        for kernel in ["fused", "dense"]:
            torch.manual_seed(0)
            reference = TinyDLRM()
            dmp = DistributedModelParallel(
                copy.deepcopy(reference), plan=plan(kind, ws, kernel), sharders=sharders(False)
            )
            got = train(dmp, make_optimizer(dmp, kernel == "fused", False), range(STEPS), rank, ws)
            want = train(reference, make_optimizer(reference, False, False), range(STEPS), 0, 1)
            key = f"{kind}/{kernel}"
            if not torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5):
                problems[key] = [f"losses {got} != {want}"]
            if set(dmp.state_dict()) != set(reference.state_dict()):
                problems.setdefault(key, []).append(
                    f"keys {sorted(dmp.state_dict())} != {sorted(reference.state_dict())}"
                )
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
def test_dmp_training_equals_single_process(world_size: int) -> None:
    results = run_ranks(world_size, equivalence, timeout=400)
    assert results[0] == {}, results[0]


def save_phase(rank: int, ws: int, path: str, threads: int) -> List[float]:
    torch.set_num_threads(threads)  # 2: fused groups cut into kernels that run side by side
    dmp = build("table_wise", ws, "fused", adagrad=True)
    opt = make_optimizer(dmp, True, True)
    train(dmp, opt, range(2), rank, ws)
    checkpoint.save(path, dmp, opt, extra={"step": 2})
    return train(dmp, opt, range(2, STEPS), rank, ws)  # the uninterrupted run


def load_phase(rank: int, ws: int, path: str, kind: str, threads: int) -> List[float]:
    torch.set_num_threads(threads)
    dmp = build(kind, ws, "fused", adagrad=True)
    opt = make_optimizer(dmp, True, True)
    extra = checkpoint.load(path, dmp, opt)
    assert extra == {"step": 2}
    return train(dmp, opt, range(2, STEPS), rank, ws)


def plain_first_loss(path: str) -> float:
    """An unsharded model loads the tables and dense weights (no optimizer state)."""
    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    plain = TinyDLRM()
    assert checkpoint.load(path, plain) == {"step": 2}
    dense, kjt, labels = batch_for(2, 0, 1)
    return plain(dense, kjt, labels).item()


def test_checkpoint_reshards_across_world_sizes_and_plans() -> None:
    with tempfile.TemporaryDirectory() as path:
        uninterrupted = run_ranks(2, save_phase, path, 2, timeout=200)[0]
        for ws, kind, threads in [
            (3, "row_wise", 1),
            (3, "column_wise", 1),
            (1, "table_wise", 1),
            (1, "table_wise", 2),
        ]:
            resumed = run_ranks(ws, load_phase, path, kind, threads, timeout=200)[0]
            torch.testing.assert_close(
                torch.tensor(resumed),
                torch.tensor(uninterrupted),
                atol=1e-5,
                rtol=0,
                msg=f"resumed on {ws} ranks, {kind}, {threads} threads",
            )
        assert abs(plain_first_loss(path) - uninterrupted[0]) < 1e-5


def planned_from_meta(rank: int, ws: int) -> Dict[str, object]:
    """No plan given: rank 0's planner decides, every rank gets the same plan; the model was
    built on meta and DMP materializes it."""
    torch.manual_seed(rank)  # different seeds: replicated parts must still agree
    dmp = DistributedModelParallel(TinyDLRM("meta"), sharders=sharders(False))
    opt = make_optimizer(dmp, True, False)
    losses = train(dmp, opt, range(3), rank, ws)
    dense = [
        p.detach().clone() for n, p in dmp.named_parameters() if n.startswith(("dense", "over"))
    ]
    gathered: List = [None] * ws
    torch.distributed.all_gather_object(gathered, dense)
    same = all(torch.equal(a, b) for other in gathered for a, b in zip(gathered[0], other))
    plan = {t: (ps.sharding_type, ps.ranks) for t, ps in dmp.plan.plan["ebc"].items()}
    return {"plan": plan, "losses": losses, "dense_equal": same}


def test_dmp_plans_and_materializes_when_no_plan_is_given() -> None:
    results = run_ranks(2, planned_from_meta, timeout=200)
    assert results[0]["plan"] == results[1]["plan"] and set(results[0]["plan"]) == {
        "ta",
        "tb",
        "tc",
    }
    assert all(r["dense_equal"] for r in results)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)
