"""`benchmarks.ranks.run_ranks(..., local_world_size=L)` gives its rank processes torchrun's host
layout (`LOCAL_WORLD_SIZE`, `LOCAL_RANK`), so a plan made for hosts of L ranks is built as
one: a table-row-wise plan for 1-rank hosts used to be rejected as if both ranks shared a host.
"""

from __future__ import annotations

import os
from typing import Tuple

import pytest
import torch.distributed as dist

from benchmarks.planner_accuracy import Allocator, Workload, metas, parse_args, rank_measure
from benchmarks.ranks import run_ranks
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from recshard.types import ShardingEnv


def _layout() -> Tuple[str, str, int]:
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"], env.local_world_size


@pytest.mark.parametrize(
    "local_world_size, expected",
    [
        (1, [("1", "0", 1), ("1", "0", 1)]),
        (None, [("2", "0", 2), ("2", "1", 2)]),
    ],
)
def test_run_ranks_sets_host_layout(local_world_size, expected) -> None:
    args = parse_args(["--quick", "--timeout", "120"])
    assert run_ranks(2, args, _layout, local_world_size=local_world_size) == expected


def test_run_ranks_rejects_layout_not_dividing_world() -> None:
    args = parse_args(["--quick"])
    with pytest.raises(ValueError, match="local_world_size 2 must divide world_size 3"):
        run_ranks(3, args, _layout, local_world_size=2)


def test_table_row_wise_plan_for_one_rank_hosts_runs() -> None:
    args = parse_args(["--quick", "--local-world-size", "1", "--timeout", "300"])
    w = Workload(16, "uniform", 64)
    tables = metas(w, args.row_cap, args.max_pooling)
    forced = {
        t.name: ParameterConstraints(sharding_types=["table_row_wise"], compute_kernels=["fused"])
        for t in tables
    }
    plan = EmbeddingShardingPlanner(
        Topology(2, local_world_size=1), w.batch, constraints=forced, debug=False
    ).plan_tables(tables)
    # on 1-rank hosts table-row-wise keeps each table on one rank
    assert {len(ps.ranks) for ps in plan.plan[""].values()} == {1}
    per_rank = run_ranks(2, args, rank_measure, plan, w, args, Allocator.TIMING, local_world_size=1)
    assert [len(r["times"]) for r in per_rank] == [args.steps, args.steps]
