"""Per-step costs that do not scale with any one shard: each sharding group's overhead, from
a calibration profile (`StepTimePerfModel`).

A sharded module runs one group per (sharding type, compute kernel): one lookup call on every
rank, the group's collectives and their bookkeeping, whatever the number of tables in it, plus
some per feature (splits, permutes, output columns). The planner's per-shard estimates cannot
carry these, so the step model adds them once per group present in a plan: the measured
overhead of a real sharded module of that type (`CalibrationProfile.step_ms`), or, for a
profile without it, the group's collective latencies and its kernel's per-call time.
"""

from __future__ import annotations

from typing import Dict, Iterable, Tuple

from recshard.planner.placement import PartitionResult
from recshard.planner.planner_types import Topology

_KJT = ("all_to_all",) * 3  # input dist: splits, lengths, values
# Collectives one group issues per step (forward and backward), by sharding type.
COLLECTIVES: Dict[str, Tuple[str, ...]] = {
    "table_wise": _KJT + ("all_to_all", "all_to_all"),
    "column_wise": _KJT + ("all_to_all", "all_to_all"),
    "table_column_wise": _KJT + ("all_to_all", "all_to_all"),
    "row_wise": _KJT + ("reduce_scatter", "all_gather"),
    "table_row_wise": _KJT + ("reduce_scatter", "all_to_all", "all_to_all", "all_gather"),
    "data_parallel": ("reduce_scatter", "all_gather"),  # the gradient all-reduce
}

Group = Tuple[str, str, int, int]  # sharding type, compute kernel, embedding dim, features


class StepTimePerfModel:
    """Rates a placement by its slowest rank plus each sharding group's fixed cost (ms), from
    `topology.profile` (see the module docstring). Without a profile it is `NoopPerfModel`
    (fixed cost 0)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def group_ms(
        self, sharding_type: str, compute_kernel: str, dim: int, features: int = 1
    ) -> float:
        """Fixed ms per step of one (sharding type, kernel) group with rows `dim` wide,
        serving `features` features."""
        profile = self.topology.profile
        if profile is None or self.topology.world_size == 1:
            return 0.0
        same_device = profile.compute_device == self.topology.compute_device
        measured = profile.step_ms(sharding_type, features) if same_device else None
        if measured is not None:
            return measured
        multi_host = self.topology.num_hosts > 1
        total = 0.0
        for collective in COLLECTIVES[sharding_type]:
            total += profile.latency_ms(collective, multi_host) or 0.0
        if same_device:
            kernel = "dense" if sharding_type == "data_parallel" else compute_kernel
            total += profile.call_ms(kernel, dim)
        return total

    def fixed_ms(self, groups: Iterable[Group]) -> float:
        """Sum of `group_ms` over the distinct (type, kernel) groups, at their widest dim
        and with all their features."""
        widest: Dict[Tuple[str, str], Tuple[int, int]] = {}
        for sharding_type, kernel, dim, features in groups:
            key = (sharding_type, kernel)
            old_dim, old_features = widest.get(key, (0, 0))
            widest[key] = (max(old_dim, dim), old_features + features)
        return sum(
            self.group_ms(st, k, dim, features) for (st, k), (dim, features) in widest.items()
        )

    def rate(self, result: PartitionResult) -> float:
        slowest = max(result.perf) if result.perf else 0.0
        if self.topology.profile is None:
            return slowest
        return slowest + self.fixed_ms(
            (o.sharding_type, o.compute_kernel, o.table.embedding_dim, len(o.table.feature_names))
            for o in result.proposal
        )
