"""Where a proposal's shards went and what each rank then carries (`PartitionResult`): what the
partitioners produce and the perf models, proposers and statistics read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List

from recshard.planner.planner_types import ShardingOption


@dataclass
class PartitionResult:
    """Where every shard of a proposal went and what each rank then carries.

    `ranks[i]` lists the rank of each shard of `proposal[i]` (data-parallel: every rank).
    Infeasible results carry `failed_index` (the table that did not fit), `failed_resource`
    ("hbm" or "ddr") and a message in `error`.
    """

    proposal: List[ShardingOption]
    ranks: List[List[int] | None]
    perf: List[float]
    hbm: List[float]
    ddr: List[float]
    rating: float = math.inf
    failed_index: int | None = None
    failed_resource: str | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.failed_index is None
