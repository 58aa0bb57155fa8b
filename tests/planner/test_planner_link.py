"""The link changes the plan: a slow inter-host link moves a large pooled table off row-wise
(whose reduce-scatter crosses hosts) to table-row-wise / table-wise; a fast one keeps it
row-wise. Through `Topology` bandwidths, a calibration profile, and the CLI flags."""

from __future__ import annotations

import json

import pytest

from recshard.planner import EmbeddingShardingPlanner, TableMeta, Topology, load_plan
from recshard.planner.cost.plan_stats import plan_stats
from recshard.planner.profile import CalibrationProfile, LinkCost
from recshard.planner.report.cli import main

TABLES = [
    TableMeta("big", 4_000_000, 128, pooling_factors=[100.0]),
    TableMeta("small", 1000, 16, pooling_factors=[1.0]),
]
BATCH = 2048


def _plan(topology: Topology):
    planner = EmbeddingShardingPlanner(topology, BATCH, debug=False)
    plan = planner.plan_tables(TABLES)
    return plan, plan.plan[""]["big"].sharding_type


def test_slow_inter_host_link_moves_row_wise_off_it():
    fast = Topology(4, local_world_size=2, intra_host_bw=100.0, inter_host_bw=100.0)
    slow = Topology(4, local_world_size=2, intra_host_bw=100.0, inter_host_bw=0.5)
    fast_plan, fast_type = _plan(fast)
    slow_plan, slow_type = _plan(slow)
    assert fast_type == "row_wise"
    assert slow_type in ("table_row_wise", "table_wise")
    # on the slow link, the chosen plan is estimated faster than the fast link's choice
    assert (
        plan_stats(slow_plan, TABLES, slow, BATCH).predicted_step_ms
        < plan_stats(fast_plan, TABLES, slow, BATCH).predicted_step_ms
    )


def _links(inter_gbps: float):
    return [
        LinkCost(c, level, 2, 100.0 if level == "intra" else inter_gbps, 0.01)
        for c in ("all_to_all", "reduce_scatter", "all_gather")
        for level in ("intra", "inter")
    ]


@pytest.mark.parametrize("inter, expect_row_wise", [(100.0, True), (0.5, False)])
def test_profile_link_decides(inter, expect_row_wise):
    profile = CalibrationProfile("cpu", 1, 4, 2, links=_links(inter))
    _, kind = _plan(Topology(4, local_world_size=2, profile=profile))
    assert (kind == "row_wise") == expect_row_wise


def test_cli_flags_decide(tmp_path):
    tables = tmp_path / "tables.json"
    tables.write_text(
        json.dumps(
            {
                "batch_size": BATCH,
                "tables": [
                    {
                        "name": t.name,
                        "num_embeddings": t.num_embeddings,
                        "embedding_dim": t.embedding_dim,
                        "pooling_factor": t.pooling_factors[0],
                    }
                    for t in TABLES
                ],
            }
        )
    )
    kinds = {}
    for gbps in ("100", "0.5"):
        out = str(tmp_path / f"plan{gbps}.json")
        assert (
            main(
                [
                    str(tables),
                    "--world-size",
                    "4",
                    "--local-world-size",
                    "2",
                    "--intra-host-gbps",
                    "100",
                    "--inter-host-gbps",
                    gbps,
                    "-o",
                    out,
                ]
            )
            == 0
        )
        kinds[gbps] = load_plan(out).plan[""]["big"].sharding_type
    assert kinds["100"] == "row_wise" and kinds["0.5"] in ("table_row_wise", "table_wise")
