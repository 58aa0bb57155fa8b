"""Proposers: which option each table uses. A proposal is a list with one `ShardingOption`
per table (in table order); after each one the planner reports how it partitioned
(`feedback`), and the proposer picks the next, or returns None when it is done."""

from __future__ import annotations

import itertools
import logging
import math
from typing import Iterator, List, Optional, Set, Tuple

from recshard.planner.partitioners import PartitionResult
from recshard.planner.types import ShardingOption

logger = logging.getLogger(__name__)
SearchSpace = List[List[ShardingOption]]


class Proposer:
    """Base: `load` the search space, then alternate `propose` and `feedback`."""

    def load(self, search_space: SearchSpace) -> None:
        raise NotImplementedError

    def propose(self) -> Optional[List[ShardingOption]]:
        raise NotImplementedError

    def feedback(self, result: PartitionResult) -> None:
        """Most proposers ignore feedback."""


def _by_perf(options: List[ShardingOption]) -> List[ShardingOption]:
    return sorted(options, key=lambda o: (o.total_perf, o.max_perf))


def _contribution(option: ShardingOption, ranks: List[int], rank: int) -> float:
    """Time `option` puts on `rank`."""
    if option.partition_by == "uniform":
        start = 0
        for seg in option.segments:
            if rank < start + seg.count:
                return seg.perf_total
            start += seg.count
        return 0.0
    return sum(cost[0] for cost, r in zip(option.costs, ranks) if r == rank)  # type: ignore[arg-type]


class GreedyProposer:
    """Local search from the least total work, guided by where the plan hurts.

    Starts with every table at its cheapest option (least summed shard time). While no
    proposal fits: if the summed need of the short memory exceeds the summed capacity (less
    `memory_slack`), it moves as many tables as needed to options using less of it (e.g.
    fused -> UVM caching), cheapest extra time per byte saved first; otherwise it shrinks the
    table that did not fit (or the biggest user of that memory) to its cheapest option with
    smaller shards.
    Once a plan fits, each step takes the slowest rank, and moves the table that puts most
    time on it to its cheapest option whose largest shard is smaller (e.g. table-wise ->
    column-wise -> row-wise). Moves that do not lower the slowest rank's time are undone and
    not retried; the search stops after `patience` such moves in a row, when no move is left,
    or after `max_proposals`.
    """

    def __init__(
        self, patience: int = 12, max_proposals: int = 2000, memory_slack: float = 0.02
    ) -> None:
        self.patience = patience
        self.max_proposals = max_proposals
        self.memory_slack = memory_slack

    def load(self, search_space: SearchSpace) -> None:
        self._space = [_by_perf(options) for options in search_space]
        self._choice = [0] * len(self._space)
        self._best: Optional[PartitionResult] = None
        self._move: Optional[Tuple[int, int]] = None
        self._tried: Set[Tuple[int, int]] = set()
        self._stale = 0
        self._count = 0
        self._done = not self._space

    def propose(self) -> Optional[List[ShardingOption]]:
        if self._done:
            return None
        self._count += 1
        return [options[c] for options, c in zip(self._space, self._choice)]

    def feedback(self, result: PartitionResult) -> None:
        best = self._best
        if result.feasible and (best is None or result.rating < best.rating * (1 - 1e-9)):
            self._best = result
            self._stale = 0
            self._tried.clear()
        elif best is not None:
            if self._move is not None:  # undo the move that did not help
                t, previous = self._move
                self._tried.add((t, self._choice[t]))
                self._choice[t] = previous
            self._stale += 1
        self._move = None
        if self._stale >= self.patience or self._count >= self.max_proposals:
            self._done = True
        elif self._best is None:
            self._done = not self._memory_step(result)
        else:
            move = self._balance_move(self._best)
            if move is None:
                self._done = True
            else:
                t, index = move
                self._move = (t, self._choice[t])
                self._choice[t] = index

    def _cheapest_smaller(self, t: int, resource: str, per_shard: bool) -> Optional[int]:
        options = self._space[t]
        current = options[self._choice[t]]

        def usage(o: ShardingOption) -> float:
            if per_shard:
                return o.max_hbm if resource == "hbm" else o.max_ddr
            return o.total_hbm if resource == "hbm" else o.total_ddr

        limit = usage(current) * (1 - 1e-9)
        for k, option in enumerate(options):  # sorted by total perf: first hit is cheapest
            if usage(option) < limit:
                return k
        return None

    def _memory_step(self, result: PartitionResult) -> bool:
        """Change choices so the next proposal needs less of the memory that fell short:
        many tables at once while the total need exceeds the total capacity (+ slack), else
        the table that did not fit. False if nothing can shrink."""
        t, resource = result.failed_index, result.failed_resource or "hbm"
        if t is None:
            return False
        total = sum((o.total_hbm if resource == "hbm" else o.total_ddr) for o in result.proposal)
        excess = result.extra.get("deficit", {}).get(resource, 0.0) + self.memory_slack * total
        if excess > 0 and self._shrink_many(resource, excess):
            return True
        index = self._cheapest_smaller(t, resource, per_shard=True)
        if index is None:  # shrink the biggest user of that memory instead
            users = [(options[self._choice[u]].total_hbm if resource == "hbm"
                      else options[self._choice[u]].total_ddr, u)
                     for u, options in enumerate(self._space)]
            for _, u in sorted(users, reverse=True):
                index = self._cheapest_smaller(u, resource, per_shard=False)
                if index is not None:
                    t = u
                    break
        if index is None:
            return False
        self._choice[t] = index
        return True

    def _shrink_many(self, resource: str, need: float) -> bool:
        """Move tables to options that use less of `resource` (HBM -> UVM, DDR -> ...) until
        `need` bytes are freed, cheapest time per byte first. False if nothing can move."""
        moves = []
        for t, options in enumerate(self._space):
            current = options[self._choice[t]]
            use = current.total_hbm if resource == "hbm" else current.total_ddr
            best = None
            for k, option in enumerate(options):
                saved = use - (option.total_hbm if resource == "hbm" else option.total_ddr)
                if saved > 0:
                    cost = max(0.0, option.total_perf - current.total_perf) / saved
                    if best is None or cost < best[0]:
                        best = (cost, saved, t, k)
            if best is not None:
                moves.append(best)
        if not moves:
            return False
        moves.sort()
        freed = 0.0
        for _, saved, t, k in moves:
            if freed >= need:
                break
            self._choice[t] = k
            freed += saved
        return True

    def _balance_move(self, best: PartitionResult) -> Optional[Tuple[int, int]]:
        perf = best.perf
        slowest = max(range(len(perf)), key=perf.__getitem__)
        candidates = []
        for t, (option, ranks) in enumerate(zip(best.proposal, best.ranks)):
            if ranks is not None and (option.partition_by == "uniform" or slowest in ranks):
                share = _contribution(option, ranks, slowest)
                if share > 0:
                    candidates.append((share, t))
        candidates.sort(reverse=True)
        for share, t in candidates:
            for k, option in enumerate(self._space[t]):
                if k != self._choice[t] and (t, k) not in self._tried and (
                    option.max_perf < share * (1 - 1e-6)
                ):
                    return t, k
        return None


class UniformProposer:
    """One proposal per sharding type that every table allows: all tables that type, each on
    its cheapest kernel / shard count."""

    def load(self, search_space: SearchSpace) -> None:
        proposals = []
        types = {o.sharding_type for options in search_space for o in options}
        for st in sorted(types):
            proposal = []
            for options in search_space:
                matching = [o for o in options if o.sharding_type == st]
                if not matching:
                    break
                proposal.append(min(matching, key=lambda o: (o.total_perf, o.max_perf)))
            else:
                proposals.append(proposal)
        self._proposals: Iterator[List[ShardingOption]] = iter(proposals)

    def propose(self) -> Optional[List[ShardingOption]]:
        return next(self._proposals, None)

    def feedback(self, result: PartitionResult) -> None:
        pass


class GridSearchProposer:
    """Every combination of options, only when there are at most `max_proposals` of them
    (a handful of tables); otherwise it proposes nothing."""

    def __init__(self, max_proposals: int = 1000) -> None:
        self.max_proposals = max_proposals

    def load(self, search_space: SearchSpace) -> None:
        total = math.prod(len(options) for options in search_space) if search_space else 0
        if total > self.max_proposals or total == 0:
            if total:
                logger.debug("grid search skipped: %d combinations > %d", total,
                             self.max_proposals)
            self._grid: Iterator[Tuple[ShardingOption, ...]] = iter(())
        else:
            self._grid = itertools.product(*[_by_perf(options) for options in search_space])

    def propose(self) -> Optional[List[ShardingOption]]:
        combo = next(self._grid, None)
        return None if combo is None else list(combo)

    def feedback(self, result: PartitionResult) -> None:
        pass
