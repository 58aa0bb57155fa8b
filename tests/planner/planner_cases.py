"""Shared helpers for the planner tests: random table sets and an independent feasibility check."""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.modules.embedding_configs import EmbeddingBagConfig
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.planner import (
    EmbeddingShardingPlanner,
    EmbeddingStorageEstimator,
    TableMeta,
    Topology,
)
from recshard.types import ShardingEnv, ShardingPlan


def random_tables(
    n: int, seed: int = 0, max_rows_exp: float = 6.0, optimizer: str = "exact_row_wise_adagrad"
) -> List[TableMeta]:
    """`n` tables: rows log-uniform 1e3..10^max_rows_exp, dims 32..256, pooling 1..20."""
    rng = random.Random(seed)
    tables = []
    for i in range(n):
        rows = int(10 ** rng.uniform(3, max_rows_exp))
        dim = rng.choice(range(32, 257, 8))
        features = [f"t{i}_f{k}" for k in range(rng.choice([1, 1, 2]))]
        tables.append(
            TableMeta(
                f"t{i}",
                rows,
                dim,
                feature_names=features,
                pooling_factors=[round(rng.uniform(1, 20), 1) for _ in features],
                is_weighted=rng.random() < 0.2,
                optimizer=optimizer,
            )
        )
    return tables


def memory_per_rank(
    plan: ShardingPlan, tables: List[TableMeta], topology: Topology, batch_size: int
) -> Tuple[List[float], List[float]]:
    """(HBM, DDR) bytes per rank recomputed from the plan's shards (not the planner's books)."""
    estimator = EmbeddingStorageEstimator(topology, batch_size)
    by_key: Dict[Tuple[str, str], TableMeta] = {(t.module_fqn, t.name): t for t in tables}
    hbm = [0.0] * topology.world_size
    ddr = [0.0] * topology.world_size
    for fqn, entries in plan.plan.items():
        for name, ps in entries.items():
            table = by_key[(fqn, name)]
            if ps.shards is None:
                pieces = [(r, table.num_embeddings, table.embedding_dim) for r in ps.ranks]
            else:
                pieces = [(s.rank, s.shard_sizes[0], s.shard_sizes[1]) for s in ps.shards]
            for rank, rows, cols in pieces:
                storage = estimator.estimate(
                    table, ps.sharding_type, ps.compute_kernel, rows, cols, ps.cache_params
                )
                hbm[rank] += storage.hbm
                ddr[rank] += storage.ddr
    return hbm, ddr


def assert_feasible_and_complete(
    planner: EmbeddingShardingPlanner, plan: ShardingPlan, tables: List[TableMeta]
) -> None:
    """Every table planned once; no rank over its capacity for tables."""
    planned = {(fqn, name) for fqn, entries in plan.plan.items() for name in entries}
    assert planned == {(t.module_fqn, t.name) for t in tables}
    topo = planner.topology
    hbm, ddr = memory_per_rank(plan, tables, topo, planner.batch_size)
    stats = planner.last_stats
    assert stats is not None
    for r in range(topo.world_size):
        cap = stats.ranks[r]
        assert hbm[r] <= cap.hbm_cap * (1 + 1e-6) + 1, (r, hbm[r], cap.hbm_cap)
        assert ddr[r] <= cap.ddr_cap * (1 + 1e-6) + 1, (r, ddr[r], cap.ddr_cap)
        assert abs(hbm[r] - cap.hbm) <= 1e-6 * max(1.0, hbm[r]) + 1
        assert abs(ddr[r] - cap.ddr) <= 1e-6 * max(1.0, ddr[r]) + 1


def shard_on_world(plan: ShardingPlan, rows: int, dim: int, tables: int) -> torch.nn.Module:
    """Inside a rank of a gloo group: `tables` tables `t<i>` (`rows` x `dim`, feature `f<i>`)
    sharded by `plan` with fused exact SGD, hosts of the whole world."""
    configs = [
        EmbeddingBagConfig(
            num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"]
        )
        for i in range(tables)
    ]
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.01}
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD, dist.get_world_size())
    return sharder.shard(EmbeddingBagCollection(configs, device="meta"), plan.plan[""], env)
