"""The memory search at scale: with tight HBM and DDR, the number of proposals the planner
evaluates stays bounded as the tables grow (it used to place one more table per proposal,
up to `max_proposals` = 2,000 partitions of every table, and then often gave up on a set
that fits). Counted in proposals, not seconds: each proposal is one partition, linear in
the tables."""

from __future__ import annotations

import pytest
from planner_cases import assert_feasible_and_complete, random_tables

from recshard.planner import EmbeddingEnumerator, EmbeddingShardingPlanner, PlannerError, Topology
from recshard.planner.planner_types import GIB

# Patience (12) + a doubling per step of what the search frees + the balance moves.
MAX_PROPOSALS = 120


def _tight(n: int, hbm_per_table: float, ddr_per_table: float) -> Topology:
    """8 cuda ranks whose summed HBM / DDR are `n` times the given GiB per table."""
    return Topology(
        8,
        "cuda",
        local_world_size=8,
        hbm_cap=n * hbm_per_table * GIB / 8,
        ddr_cap=n * ddr_per_table * GIB / 8,
    )


@pytest.mark.parametrize(
    "n, hbm, ddr",
    [
        (250, 0.3, 0.3),  # main: 1,877 proposals, then no plan
        (1000, 0.2, 0.4),  # main: 2,001 proposals, no plan
        (1000, 0.25, 0.35),  # main: 2,002 proposals, no plan
        (2000, 0.3, 0.3),
    ],
)
def test_tight_memory_plans_in_bounded_proposals(n, hbm, ddr):
    tables = random_tables(n, seed=0, max_rows_exp=7.0)
    planner = EmbeddingShardingPlanner(_tight(n, hbm, ddr), batch_size=512, debug=False)
    plan = planner.plan_tables(tables)
    assert_feasible_and_complete(planner, plan, tables)
    kernels = {ps.compute_kernel for ps in plan.plan[""].values()}
    assert kernels & {"fused_uvm", "fused_uvm_caching"} and "fused" in kernels
    assert planner.last_stats.num_proposals <= MAX_PROPOSALS


def test_sum_that_cannot_fit_stops_the_search_at_once():
    """Every table at its least-memory option still needs more than the ranks have: no
    split or move fits it, and the search says so after a few proposals."""
    n = 1000
    topology = _tight(n, 0.05, 0.3)
    tables = random_tables(n, seed=0, max_rows_exp=7.0)
    space = EmbeddingEnumerator(topology, 512).enumerate_tables(tables)
    least = sum(min(o.total_hbm + o.total_ddr for o in options) for options in space)
    assert least > 8 * (topology.hbm_cap + topology.ddr_cap)  # no plan exists
    planner = EmbeddingShardingPlanner(topology, batch_size=512, debug=False)
    with pytest.raises(PlannerError, match=r"evaluated (\d+) proposals") as err:
        planner.plan_tables(tables)
    evaluated = int(err.value.args[0].split("evaluated ")[1].split()[0])
    assert evaluated <= 20
