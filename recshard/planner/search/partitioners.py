"""Partitioners: put the shards of one proposal (one option per table) on ranks.

No copies: a partition works on flat per-rank lists and returns a fresh `PartitionResult`;
options are never mutated, so proposals can share them and the planner keeps the best
result as is. Uniform options (row-wise, data-parallel) are summed with difference arrays
(a row-wise table over 1,024 ranks is three additions, not 1,024); table-wise and column-wise
shards go through a min-heap of rank loads.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from itertools import accumulate
from typing import Dict, List, Sequence, Tuple

from recshard.planner.cost.reservation import Capacity
from recshard.planner.placement import PartitionResult
from recshard.planner.planner_types import GIB, ShardingOption

_EPS = 1e-9


class NoopPerfModel:
    """Rates a placement by its slowest rank: max over ranks of the summed shard perf (ms)."""

    def rate(self, result: PartitionResult) -> float:
        return max(result.perf) if result.perf else 0.0


def memory_deficit(proposal: Sequence[ShardingOption], capacity: Capacity) -> Dict[str, float]:
    """Bytes by which the proposal's summed HBM / DDR exceed the summed capacity (< 0: room)."""
    return {
        "hbm": sum(o.total_hbm for o in proposal) - sum(capacity.hbm),
        "ddr": sum(o.total_ddr for o in proposal) - sum(capacity.ddr),
    }


def _fits(need: float, used: float, cap: float) -> bool:
    return used + need <= cap * (1 + _EPS) + 1.0


def _short_resource(
    hbm: List[float], ddr: List[float], capacity: Capacity, need_hbm: float, need_ddr: float
) -> str:
    """Which memory kind no rank had room for."""
    if need_hbm and not any(_fits(need_hbm, u, c) for u, c in zip(hbm, capacity.hbm)):
        return "hbm"
    if need_ddr and not any(_fits(need_ddr, u, c) for u, c in zip(ddr, capacity.ddr)):
        return "ddr"
    return "hbm" if need_hbm >= need_ddr else "ddr"


class GreedyPerfPartitioner:
    """Places one proposal in three passes, each shard where it fits and adds least time:

    1. uniform options (row-wise: shard i on rank i; data-parallel: a replica everywhere),
    2. host options (table-row-wise, table-column-wise), largest first, on the least-loaded
       host that fits (table-column-wise shards spread least-loaded-first inside it),
    3. table-wise and column-wise shards, sorted by perf (largest first, LPT) or by storage,
       each on the least-loaded rank with room, from a min-heap of rank loads.
    If perf order leaves a shard without a rank, storage order is tried before giving up.
    """

    def __init__(self, sort_by: str = "perf") -> None:
        if sort_by not in ("perf", "storage"):
            raise ValueError(f"sort_by must be 'perf' or 'storage', got {sort_by!r}")
        self.sort_by = sort_by
        self.perf_model = NoopPerfModel()

    def partition(self, proposal: Sequence[ShardingOption], capacity: Capacity) -> PartitionResult:
        """Place `proposal` within `capacity`; the result says whether it fit."""
        result = self._partition(list(proposal), capacity, self.sort_by)
        if not result.feasible and self.sort_by == "perf" and result.extra.get("device_pass"):
            retry = self._partition(list(proposal), capacity, "storage")
            if retry.feasible:
                result = retry
        result.extra["capacity"] = capacity  # what it was placed within (refinement keeps it)
        if not result.feasible:
            result.extra["free"] = [
                (ch - h, cd - d)
                for ch, h, cd, d in zip(capacity.hbm, result.hbm, capacity.ddr, result.ddr)
            ]
            result.extra["deficit"] = memory_deficit(result.proposal, capacity)
            result.extra["rank_capacity"] = {"hbm": max(capacity.hbm), "ddr": max(capacity.ddr)}
        return result

    def _partition(
        self, proposal: List[ShardingOption], capacity: Capacity, sort_by: str
    ) -> PartitionResult:
        world = len(capacity.hbm)
        ranks: List[List[int] | None] = [None] * len(proposal)
        perf, hbm, ddr = self._place_uniform(proposal, world, ranks)
        result = PartitionResult(proposal, ranks, perf, hbm, ddr)
        cap_h, cap_d = capacity.hbm, capacity.ddr
        for r in range(world):
            if not (_fits(0.0, hbm[r], cap_h[r]) and _fits(0.0, ddr[r], cap_d[r])):
                return self._uniform_failure(result, capacity, r)
        if not self._place_hosts(result, capacity):
            return result
        if not self._place_devices(result, capacity, sort_by):
            result.extra["device_pass"] = True  # failed placing table-/column-wise shards
            return result
        result.rating = self.perf_model.rate(result)
        return result

    @staticmethod
    def _place_uniform(
        proposal: List[ShardingOption], world: int, ranks: List[List[int] | None]
    ) -> Tuple[List[float], ...]:
        d_perf = [0.0] * (world + 1)
        d_hbm = [0.0] * (world + 1)
        d_ddr = [0.0] * (world + 1)
        all_ranks = list(range(world))
        for i, option in enumerate(proposal):
            if option.partition_by != "uniform":
                continue
            start = 0
            for seg in option.segments:
                end = start + seg.count
                p, h, d = seg.perf_total, seg.storage.hbm, seg.storage.ddr
                d_perf[start] += p
                d_perf[end] -= p
                d_hbm[start] += h
                d_hbm[end] -= h
                d_ddr[start] += d
                d_ddr[end] -= d
                start = end
            ranks[i] = all_ranks
        return (
            list(accumulate(d_perf))[:world],
            list(accumulate(d_hbm))[:world],
            list(accumulate(d_ddr))[:world],
        )

    @staticmethod
    def _uniform_failure(result: PartitionResult, capacity: Capacity, rank: int) -> PartitionResult:
        over_hbm = result.hbm[rank] > capacity.hbm[rank] * (1 + _EPS) + 1.0
        resource = "hbm" if over_hbm else "ddr"
        best, worst = -1, -1.0
        for i, option in enumerate(result.proposal):
            if option.partition_by == "uniform":
                need = option.max_hbm if over_hbm else option.max_ddr
                if need > worst:
                    best, worst = i, need
        used = result.hbm[rank] if over_hbm else result.ddr[rank]
        cap = capacity.hbm[rank] if over_hbm else capacity.ddr[rank]
        result.failed_index, result.failed_resource = best, resource
        result.error = (
            f"row-wise and data-parallel tables alone need {used / GIB:.3f} GiB "
            f"{resource.upper()} on rank {rank}, which has {cap / GIB:.3f} GiB for tables; "
            f"largest: '{result.proposal[best].table.key}' ({worst / GIB:.3f} GiB per rank)"
        )
        return result

    @staticmethod
    def _place_hosts(result: PartitionResult, capacity: Capacity) -> bool:
        proposal, perf, hbm, ddr = result.proposal, result.perf, result.hbm, result.ddr
        cap_h, cap_d = capacity.hbm, capacity.ddr
        local = capacity.local_world_size
        hosts = len(perf) // local
        items = sorted(
            ((o.total_perf, i) for i, o in enumerate(proposal) if o.partition_by == "host"),
            reverse=True,
        )
        if not items:
            return True
        host_load = [sum(perf[h * local : (h + 1) * local]) for h in range(hosts)]
        for _, i in items:
            option = proposal[i]
            costs = option.costs
            row_wise = option.sharding_type == "table_row_wise"
            placed: List[int] | None = None
            for h in sorted(range(hosts), key=host_load.__getitem__):
                base = h * local
                if row_wise:
                    targets = list(range(base, base + local))
                    if all(
                        _fits(c[1], hbm[r], cap_h[r]) and _fits(c[2], ddr[r], cap_d[r])
                        for c, r in zip(costs, targets)
                    ):
                        placed = targets
                else:
                    placed = _spread_in_host(costs, base, local, perf, hbm, ddr, cap_h, cap_d)
                if placed is not None:
                    break
            if placed is None:
                need_h, need_d = option.max_hbm, option.max_ddr
                result.failed_index = i
                result.failed_resource = _short_resource(hbm, ddr, capacity, need_h, need_d)
                result.error = (
                    f"table '{option.table.key}' ({option.sharding_type}, "
                    f"{option.compute_kernel}) fits on no host: {option.num_shards} shards of up "
                    f"to {need_h / GIB:.3f} GiB HBM / {need_d / GIB:.3f} GiB DDR"
                )
                return False
            for (p, h_need, d_need), r in zip(costs, placed):
                perf[r] += p
                hbm[r] += h_need
                ddr[r] += d_need
                host_load[r // local] += p
            result.ranks[i] = placed
        return True

    @staticmethod
    def _place_devices(result: PartitionResult, capacity: Capacity, sort_by: str) -> bool:
        proposal, perf, hbm, ddr = result.proposal, result.perf, result.hbm, result.ddr
        cap_h, cap_d = capacity.hbm, capacity.ddr
        items = []
        by_perf = sort_by == "perf"
        for i, option in enumerate(proposal):
            if option.partition_by == "device":
                result.ranks[i] = [0] * option.num_shards
                for j, (p, h, d) in enumerate(option.costs):  # type: ignore[arg-type]
                    items.append((p if by_perf else h + d, p, h, d, i, j))
        items.sort(reverse=True)
        room_h = [c * (1 + _EPS) + 1.0 - u for c, u in zip(cap_h, hbm)]  # free memory per rank
        room_d = [c * (1 + _EPS) + 1.0 - u for c, u in zip(cap_d, ddr)]
        heap = [(load, r) for r, load in enumerate(perf)]
        heapq.heapify(heap)
        heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
        ranks = result.ranks
        for _, p, h, d, i, j in items:
            load, r = heap[0]
            if h <= room_h[r] and d <= room_d[r]:
                heapreplace(heap, (load + p, r))
            else:  # the least-loaded rank is full: set ranks aside until one has room
                aside = [heappop(heap)]
                while heap and (h > room_h[heap[0][1]] or d > room_d[heap[0][1]]):
                    aside.append(heappop(heap))
                if not heap:
                    _device_failure(result, capacity, room_h, room_d, i, j, h, d)
                    return False
                load, r = heappop(heap)
                heappush(heap, (load + p, r))
                for entry in aside:
                    heappush(heap, entry)
            room_h[r] -= h
            room_d[r] -= d
            ranks[i][j] = r  # type: ignore[index]
        for r, (load, _) in enumerate(sorted(heap, key=lambda e: e[1])):
            perf[r] = load
        for r in range(len(perf)):
            hbm[r] = cap_h[r] * (1 + _EPS) + 1.0 - room_h[r]
            ddr[r] = cap_d[r] * (1 + _EPS) + 1.0 - room_d[r]
        return True


def _device_failure(
    result: PartitionResult,
    capacity: Capacity,
    room_h: List[float],
    room_d: List[float],
    i: int,
    j: int,
    h: float,
    d: float,
) -> None:
    option = result.proposal[i]
    result.failed_index = i
    free_h, free_d = max(room_h), max(room_d)
    result.failed_resource = (
        "hbm" if h > free_h else ("ddr" if d > free_d else ("hbm" if h >= d else "ddr"))
    )
    result.error = (
        f"shard {j} of table '{option.table.key}' ({option.sharding_type}, "
        f"{option.compute_kernel}) needs {h / GIB:.3f} GiB HBM + {d / GIB:.3f} GiB DDR; "
        f"the most free on any rank is {free_h / GIB:.3f} GiB HBM, {free_d / GIB:.3f} GiB DDR"
    )


def _spread_in_host(
    costs: List[Tuple[float, float, float]],
    base: int,
    local: int,
    perf: List[float],
    hbm: List[float],
    ddr: List[float],
    cap_h: List[float],
    cap_d: List[float],
) -> List[int] | None:
    """Ranks in host [base, base+local) for each shard, least-loaded first; None if no fit."""
    load = perf[base : base + local]
    used_h = hbm[base : base + local]
    used_d = ddr[base : base + local]
    out = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda k: -costs[k][0]):
        p, h, d = costs[j]
        fitting = [
            k
            for k in range(local)
            if _fits(h, used_h[k], cap_h[base + k]) and _fits(d, used_d[k], cap_d[base + k])
        ]
        if not fitting:
            return None
        k = min(fitting, key=load.__getitem__)
        load[k] += p
        used_h[k] += h
        used_d[k] += d
        out[j] = base + k
    return out


class MemoryBalancedPartitioner:
    """Greedy placement, then a binary search for the lowest per-rank memory cap (HBM on cuda,
    DDR on cpu) whose placement is at most `tolerance` slower; returns the most
    memory-balanced such placement. Costs up to `max_search_count` extra partitions."""

    def __init__(self, max_search_count: int = 10, tolerance: float = 0.02) -> None:
        self.max_search_count = max_search_count
        self.tolerance = tolerance
        self.greedy = GreedyPerfPartitioner("perf")

    def partition(self, proposal: Sequence[ShardingOption], capacity: Capacity) -> PartitionResult:
        best = self.greedy.partition(proposal, capacity)
        if not best.feasible:
            return best
        on_hbm = any(capacity.hbm)
        used = best.hbm if on_hbm else best.ddr
        largest = max((o.max_hbm if on_hbm else o.max_ddr) for o in proposal)
        low, high = max(sum(used) / len(used), largest), max(used)
        limit = best.rating * (1 + self.tolerance)
        for _ in range(self.max_search_count):
            if high - low <= 1e-3 * high:
                break
            mid = (low + high) / 2
            caps = [min(c, mid) for c in (capacity.hbm if on_hbm else capacity.ddr)]
            capped = replace(
                capacity,
                hbm=caps if on_hbm else capacity.hbm,
                ddr=capacity.ddr if on_hbm else caps,
            )
            trial = self.greedy.partition(proposal, capped)
            if trial.feasible and trial.rating <= limit:
                best, high = trial, mid
            else:
                low = mid
        return best
