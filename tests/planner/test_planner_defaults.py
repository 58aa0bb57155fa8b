"""The planner's out-of-the-box plan (built-in costs, no calibration profile) on the anchor
workload of `benchmarks/ebc.py` and `benchmarks/dlrm_compare.py`: 26 Criteo-like tables
(dim 64, rows capped at 200 k), their fixed pooling factors, per-rank batch 2048, 2 CPU ranks.

Every table table-wise on the fused kernel is the fastest plan measured there; data-parallel
tiny tables cost a dense kernel, a gradient all-reduce and a dense optimizer step per step
(1.25x slower in one measurement), so the default plan must not pick them.
"""

from __future__ import annotations

import pytest

from benchmarks.ebc_workload import Sizes, pooling_factors, table_rows
from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.models.dlrm import DLRM, DLRMTrain
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

SIZES = Sizes()
ROWS = table_rows(SIZES)
POOLING = pooling_factors(len(ROWS), SIZES.max_pooling)


def _tables():
    return [
        EmbeddingBagConfig(
            num_embeddings=n, embedding_dim=SIZES.dim, name=f"t{i}", feature_names=[f"cat_{i}"]
        )
        for i, n in enumerate(ROWS)
    ]


def _plan(model, optimizer, kernels, path):
    constraints = {
        f"t{i}": ParameterConstraints(compute_kernels=kernels, pooling_factors=[float(p)])
        for i, p in enumerate(POOLING)
    }
    planner = EmbeddingShardingPlanner(
        Topology(2, "cpu", local_world_size=2),
        batch_size=SIZES.batch,
        constraints=constraints,
        debug=False,
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": optimizer, "learning_rate": 0.01}
    )
    plan = planner.plan(model, [sharder]).plan[path]
    return plan, planner.last_stats


@pytest.mark.parametrize("kernels", [["fused"], None])
@pytest.mark.parametrize("optimizer", ["exact_sgd", "exact_row_wise_adagrad"])
def test_anchor_ebc_is_all_table_wise_fused(kernels, optimizer):
    ebc = EmbeddingBagCollection(_tables(), device="meta")
    plan, stats = _plan(ebc, optimizer, kernels, "")
    assert {(p.sharding_type, p.compute_kernel) for p in plan.values()} == {("table_wise", "fused")}
    assert sorted(plan) == sorted(f"t{i}" for i in range(len(ROWS)))
    assert {p.ranks[0] for p in plan.values()} == {0, 1}
    assert stats.imbalance <= 1.05, stats


def test_anchor_dlrm_is_all_table_wise_fused():
    ebc = EmbeddingBagCollection(_tables(), device="meta")
    model = DLRMTrain(DLRM(ebc, 13, [512, 256, 64], [512, 256, 1], dense_device="meta"))
    plan, _ = _plan(
        model, "exact_row_wise_adagrad", None, "model.sparse_arch.embedding_bag_collection"
    )
    assert {(p.sharding_type, p.compute_kernel) for p in plan.values()} == {("table_wise", "fused")}
