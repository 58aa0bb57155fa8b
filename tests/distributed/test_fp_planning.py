"""The planner plans a FeatureProcessedEmbeddingBagCollection with DMP's default sharders: its
tables are planned as weighted (the position weights travel with the ids), its plan names the
module, and the position weights count as dense parameters."""

from __future__ import annotations

from fp_cases import Model, make_fp_ebc

from recshard.distributed import default_sharders
from recshard.planner import EmbeddingShardingPlanner, Topology
from recshard.planner.search.enumerator import tables_from_module


def test_planner_sees_weighted_tables_of_a_fp_ebc() -> None:
    model = Model(make_fp_ebc("collection"))
    tables, _ = tables_from_module(model, default_sharders(), "cpu")
    assert sorted(t.name for t in tables) == ["t0", "t1", "t2", "t3", "t4"]
    assert all(t.is_weighted and t.module_fqn == "fp" for t in tables)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"))
    plan = planner.plan(model, default_sharders())
    assert set(plan.get_plan_for_module("fp")) == {"t0", "t1", "t2", "t3", "t4"}
