"""DistributedModelParallel refuses, on every rank, ranks that were given different plans or
models, naming what differs and each rank's value; the same plan and model go through.

Each scenario builds a DMP on 2 ranks where rank 1's plan or model differs from rank 0's: a
table sharded another way, a different table list, another table size, another learning rate
in the sharder's fused params, a plan naming a module only one rank has. Before the check,
the first three trained with a silently wrong loss (issue #37).
"""

from __future__ import annotations

import re
from typing import Dict, List

import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from recshard.types import ShardingEnv, ShardingPlan


class Model(nn.Module):
    def __init__(self, rows: Dict[str, int]) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=n, embedding_dim=4, name=t, feature_names=[f"f{t}"]
                )
                for t, n in rows.items()
            ],
            device=torch.device("meta"),
        )


def _build(rank: int, scenario: str) -> None:
    """Build the DMP of `scenario` as rank `rank` sees it."""
    other = rank == 1
    rows = {"t0": 10, "t1": 6}
    if scenario == "table list" and other:
        rows["t2"] = 8
    if scenario == "table size" and other:
        rows["t1"] = 7
    model = Model(rows)
    per_table = {t: table_wise(i % 2) for i, t in enumerate(rows)}
    if scenario == "sharding" and other:
        per_table["t0"] = row_wise()
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, per_table, world_size=2)})
    if scenario == "module path" and other:
        plan = ShardingPlan({"sparse": plan.plan["ebc"]})
    rate = 0.2 if scenario == "fused params" and other else 0.1
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": rate}
    )
    DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=plan,
        sharders=[sharder],
    )


SCENARIOS = {
    "same": [],
    "sharding": [r"module 'ebc' table 't0' sharding_type: rank 0 'table_wise', rank 1 'row_wise'"],
    "table list": [
        r"module 'ebc' tables in the model: rank 0 \['t0', 't1'\], rank 1 \['t0', 't1', 't2'\]",
        r"module 'ebc' table 't2' shape: rank 0 <absent>, rank 1 \(8, 4\)",
    ],
    "table size": [r"module 'ebc' table 't1' num_embeddings: rank 0 6, rank 1 7"],
    "fused params": [r"module 'ebc' table 't0' fused params: .*'learning_rate': 0.1.*rank 1"],
    "module path": [r"plan error: rank 0 <absent>, rank 1 the plan names module 'sparse'"],
}


def build_each(rank: int, ws: int) -> Dict[str, List[str]]:
    outcome: Dict[str, List[str]] = {}
    for scenario in SCENARIOS:
        try:
            _build(rank, scenario)
            outcome[scenario] = ["built", ""]
        except ValueError as e:
            outcome[scenario] = ["ValueError", str(e)]
    return outcome


def test_ranks_with_different_plans_or_models_are_refused_on_every_rank() -> None:
    per_rank = run_ranks(2, build_each, timeout=120, pg_timeout_s=30)
    for scenario, patterns in SCENARIOS.items():
        for rank, outcome in enumerate(per_rank):
            kind, message = outcome[scenario]
            if not patterns:
                assert kind == "built", (scenario, rank, message)
                continue
            assert kind == "ValueError", (scenario, rank, kind)
            assert "the ranks were given different plans or models" in message, message
            for pattern in patterns:
                assert re.search(pattern, message), (scenario, rank, pattern, message)
        assert per_rank[0][scenario] == per_rank[1][scenario], scenario
