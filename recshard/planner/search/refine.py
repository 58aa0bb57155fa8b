"""Local refinement of a placement: move or swap table-/column-wise shards off the slowest
rank while that lowers it. Greedy (LPT) placement leaves the last shards it placed uneven;
this closes most of that gap. Each round searches by binary search over each rank's shards
sorted by time (near-linear in the number of shards), and a deadline bounds the whole."""

from __future__ import annotations

import bisect
import heapq
import time
from typing import Callable, Iterator, List

from recshard.planner.cost.reservation import Capacity
from recshard.planner.placement import PartitionResult

_EPS = 1e-9


def _nearest(keys: List[float], target: float) -> Iterator[int]:
    """Indices of the sorted `keys`, nearest `target` first, alternating outwards."""
    right = bisect.bisect_left(keys, target)
    left = right - 1
    while left >= 0 or right < len(keys):
        if right >= len(keys) or (left >= 0 and target - keys[left] <= keys[right] - target):
            yield left
            left -= 1
        else:
            yield right
            right += 1


def refine_placement(
    result: PartitionResult,
    capacity: Capacity,
    max_rounds: int | None = None,
    receivers: int = 8,
    deadline: float | None = None,
    probes: int = 16,
    clock: Callable[[], float] = time.monotonic,
) -> PartitionResult:
    """A copy of a feasible `result` with its slowest rank relieved, one step at a time.

    Each round takes the slowest rank R and, among the `receivers` least-loaded ranks r, a
    shard move R -> r or swap (x on R, y on r, x slower than y) that lowers max(time R,
    time r), if memory allows: the move whose time is nearest half the gap, and for each x the
    y whose time is nearest x's less half the gap (`probes` nearest candidates tried for
    memory, by binary search over each rank's shards sorted by time), so a round costs
    O(receivers x shards per rank x log) instead of its square. Every step lowers the sum of
    squared rank times, so it ends; it stops when the slowest rank cannot be lowered, after
    `max_rounds` (default 4 x world size), or at `deadline` (a `clock()` reading, by default
    `time.monotonic()`; checked before every round). The result's `rating` is the new slowest
    rank's time.
    """
    if not result.feasible:
        return result
    perf, hbm, ddr = list(result.perf), list(result.hbm), list(result.ddr)
    world = len(perf)
    cap_h = [c * (1 + _EPS) + 1.0 for c in capacity.hbm]
    cap_d = [c * (1 + _EPS) + 1.0 for c in capacity.ddr]
    ranks: List[List[int] | None] = list(result.ranks)
    copied: set = set()
    on_rank: List[List[list]] = [[] for _ in range(world)]  # sorted by time
    for i, option in enumerate(result.proposal):
        if option.partition_by == "device":
            for j, (p, h, d) in enumerate(option.costs):  # type: ignore[arg-type]
                on_rank[ranks[i][j]].append([p, h, d, i, j])  # type: ignore[index]
    for items in on_rank:
        items.sort(key=lambda item: item[0])
    times = [[item[0] for item in items] for items in on_rank]

    def fits(rank: int, dh: float, dd: float) -> bool:
        return hbm[rank] + dh <= cap_h[rank] and ddr[rank] + dd <= cap_d[rank]

    def take(item: list, rank: int) -> None:
        at = bisect.bisect_left(times[rank], item[0])
        while on_rank[rank][at] is not item:
            at += 1
        del on_rank[rank][at], times[rank][at]

    def place(item: list, src: int, dst: int) -> None:
        p, h, d, i, j = item
        take(item, src)
        at = bisect.bisect_right(times[dst], p)
        on_rank[dst].insert(at, item)
        times[dst].insert(at, p)
        perf[src] -= p
        perf[dst] += p
        hbm[src] -= h
        hbm[dst] += h
        ddr[src] -= d
        ddr[dst] += d
        if i not in copied:
            ranks[i] = list(ranks[i])  # type: ignore[arg-type]
            copied.add(i)
        ranks[i][j] = dst  # type: ignore[index]

    for _ in range(max_rounds if max_rounds is not None else 4 * world):
        if deadline is not None and clock() > deadline:
            break
        slow = max(range(world), key=perf.__getitem__)
        top = perf[slow]
        best_value, best_move = top * (1 - 1e-9), None
        for r in heapq.nsmallest(receivers + 1, range(world), key=perf.__getitem__):
            gap = top - perf[r]
            if r == slow or gap <= 0:
                continue
            for tried, k in enumerate(_nearest(times[slow], gap / 2)):
                x = on_rank[slow][k]
                if tried >= probes:
                    break
                if 0 < x[0] < gap and fits(r, x[1], x[2]):
                    value = max(top - x[0], perf[r] + x[0])
                    if value < best_value:
                        best_value, best_move = value, (x, None, r)
            for x in on_rank[slow]:
                for tried, k in enumerate(_nearest(times[r], x[0] - gap / 2)):
                    if tried >= probes:
                        break
                    y = on_rank[r][k]
                    delta = x[0] - y[0]
                    if (
                        0 < delta < gap
                        and fits(r, x[1] - y[1], x[2] - y[2])
                        and fits(slow, y[1] - x[1], y[2] - x[2])
                    ):
                        value = max(top - delta, perf[r] + delta)
                        if value < best_value:
                            best_value, best_move = value, (x, y, r)
                        break  # nearer ones first: the rest are no better
        if best_move is None:
            break
        x, y, r = best_move
        place(x, slow, r)
        if y is not None:
            place(y, r, slow)
    refined = PartitionResult(result.proposal, ranks, perf, hbm, ddr, extra=dict(result.extra))
    refined.rating = max(perf)
    return refined
