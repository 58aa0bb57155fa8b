"""One validator: a bad plan gets the same error, naming the table and the bad value, from
`validate_plan` (planner, `load_plan`) and from the sharder that DMP calls."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict

import pytest
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, ParameterSharding, ShardingEnv
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.plan import column_wise, construct_module_sharding_plan, row_wise, table_row_wise
from recshard.plan.validate import PlanValidationError, validate_plan
from recshard.types import ShardingPlan

WORLD, LOCAL = 4, 2


@dataclass(frozen=True)
class BadPlan:
    name: str
    breaks: Callable[[Dict[str, ParameterSharding]], None]  # spoils a good plan in place
    error: str  # regex on the message, after "table '<name>': "


def _swap_first_two_ranks(entry: ParameterSharding) -> None:
    a, b = entry.shards[0], entry.shards[1]
    a.placement, b.placement = b.placement, a.placement


CASES = [
    BadPlan(
        "row_wise_out_of_rank_order",
        lambda p: _swap_first_two_ranks(p["rw"]),
        r"row_wise shards must sit on ranks 0..3 in order, got \[1, 0, 2, 3\]",
    ),
    BadPlan(
        "table_row_wise_out_of_node_order",
        lambda p: _swap_first_two_ranks(p["twrw"]),
        r"table_row_wise shards must sit on ranks \[2, 3\] in order, got \[3, 2\]",
    ),
    BadPlan(
        "column_gap",
        lambda p: p["cw"].shards[1].shard_offsets.__setitem__(1, 5),
        r"column shards leave a gap or overlap at 4 \(next shard starts at 5\)",
    ),
    BadPlan(
        "unknown_kernel",
        lambda p: setattr(p["rw"], "compute_kernel", "magic"),
        r"unknown compute kernel 'magic'",
    ),
    BadPlan(
        "rank_outside_world",
        lambda p: setattr(p["cw"].shards[0], "placement", "rank:7/cpu"),
        r"ranks \[7\] are outside world size 4",
    ),
    BadPlan(
        "ranks_disagree_with_placements",
        lambda p: setattr(p["cw"], "ranks", [0, 2]),
        r"ranks: \[0, 2\] do not agree with the shards' placements \(ranks \[0, 1\]\)",
    ),
    BadPlan(
        "missing_shards",
        lambda p: setattr(p["rw"], "shards", None),
        r"row_wise needs shard metadata",
    ),
]


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=16, embedding_dim=8, name=name, feature_names=[f"f_{name}"]
            )
            for name in ("rw", "twrw", "cw")
        ],
        device="meta",
    )


def _good_plan(ebc: EmbeddingBagCollection) -> Dict[str, ParameterSharding]:
    return construct_module_sharding_plan(
        ebc,
        {"rw": row_wise(), "twrw": table_row_wise(1), "cw": column_wise([0, 1])},
        local_size=LOCAL,
        world_size=WORLD,
    )


class _Holder(nn.Module):
    """A model with the EBC at path 'ebc'."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_plan_gets_one_error_from_validate_plan_and_the_sharder(case: BadPlan) -> None:
    ebc = _ebc()
    plan = _good_plan(ebc)
    validate_plan(ShardingPlan({"ebc": plan}), _Holder(ebc), WORLD, LOCAL)  # good before
    case.breaks(plan)
    with pytest.raises(PlanValidationError) as planner_side:
        validate_plan(ShardingPlan({"ebc": plan}), _Holder(ebc), WORLD, LOCAL)
    env = ShardingEnv(WORLD, 0, None, local_world_size=LOCAL)
    with pytest.raises(PlanValidationError) as sharder_side:
        EmbeddingBagCollectionSharder().shard(ebc, plan, env)
    planner_message = str(planner_side.value).replace("table 'ebc.", "table '")
    assert re.search(case.error, planner_message), planner_message
    assert planner_message.split(": ", 1)[1] == str(sharder_side.value).split(": ", 1)[1]
