"""A planner plan trains through DistributedModelParallel exactly like the unsharded model."""

from __future__ import annotations

import copy
from typing import List, Tuple

import torch
from dmp_cases import TinyDLRM, make_optimizer, train
from multiprocess import run_ranks

from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology


def _train_with_planned_plan(rank: int, world_size: int) -> Tuple[List[float], List[float], str]:
    from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder

    torch.manual_seed(0)
    reference = TinyDLRM()
    sharders = [
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "exact_sgd", "learning_rate": 0.05}
        )
    ]
    constraints = {
        "ta": ParameterConstraints(sharding_types=["column_wise"], min_partition=2),
        "tb": ParameterConstraints(sharding_types=["row_wise"]),
        "tc": ParameterConstraints(sharding_types=["table_row_wise"]),
    }
    planner = EmbeddingShardingPlanner(
        Topology(world_size, local_world_size=1), constraints=constraints, debug=False
    )
    plan = planner.collective_plan(reference, sharders)
    dmp = DistributedModelParallel(copy.deepcopy(reference), sharders=sharders, plan=plan)
    got = train(dmp, make_optimizer(dmp, True, False), range(3), rank, world_size)
    want = train(reference, make_optimizer(reference, False, False), range(3), 0, 1)
    return got, want, str(plan)


def test_planned_plan_trains_like_unsharded():
    results = run_ranks(2, _train_with_planned_plan, timeout=200, env={"LOCAL_WORLD_SIZE": "1"})
    got, want, plan = results[0]
    assert "column_wise" in plan and "table_row_wise" in plan
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5), (got, want)
