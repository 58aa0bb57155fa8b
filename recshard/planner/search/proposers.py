"""Proposers: which option each table uses. A proposal is a list with one `ShardingOption`
per table (in table order); after each one the planner reports how it partitioned
(`feedback`), and the proposer picks the next, or returns None when it is done."""

from __future__ import annotations

import itertools
import logging
import math
from typing import Dict, Iterator, List, Set, Tuple

from recshard.planner.placement import PartitionResult
from recshard.planner.planner_types import ShardingOption

logger = logging.getLogger(__name__)
SearchSpace = List[List[ShardingOption]]


class Proposer:
    """Base: `load` the search space, then alternate `propose` and `feedback`."""

    def load(self, search_space: SearchSpace) -> None:
        raise NotImplementedError

    def propose(self) -> List[ShardingOption] | None:
        raise NotImplementedError

    def feedback(self, result: PartitionResult) -> None:
        """Most proposers ignore feedback."""


def _by_perf(options: List[ShardingOption]) -> List[ShardingOption]:
    return sorted(options, key=lambda o: (o.total_perf, o.max_perf))


def _use(option: ShardingOption, resource: str, per_shard: bool = False) -> float:
    """Bytes of HBM or DDR an option needs: in total, or on its largest shard."""
    if resource == "hbm":
        return option.max_hbm if per_shard else option.total_hbm
    return option.max_ddr if per_shard else option.total_ddr


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
    The memory search takes O(log tables) proposals, each O(tables log tables): when the
    summed need cannot shrink it stops, and a shortage that keeps coming back after `patience`
    memory steps (fragmentation, one table at a time) frees a doubling amount per step.
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
        self._best: PartitionResult | None = None
        self._move: Tuple[int, int] | None = None
        self._tried: Set[Tuple[int, int]] = set()
        self._stale = 0
        self._count = 0
        self._refitted: Set[int] = set()
        self._visited: Set[int] = set()
        self._escalation = 0
        self._memory_steps = 0
        self._savings: Dict[Tuple[int, int, str], Tuple[float, float, float, int, int] | None] = {}
        self._done = not self._space

    def propose(self) -> List[ShardingOption] | None:
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
            state = hash(tuple(self._choice))
            if state in self._visited and not self._done:  # going in circles: free more
                self._escalation += 1
                resource = result.failed_resource or "hbm"
                need = (
                    self.memory_slack
                    * 2**self._escalation
                    * sum(_use(o, resource) for o in result.proposal)
                )
                other = "ddr" if resource == "hbm" else "hbm"
                room = -result.extra.get("deficit", {}).get(other, 0.0)
                self._done = self._escalation > 8 or not self._shrink_many(resource, need, room)
            self._visited.add(state)
        else:
            move = self._balance_move(self._best)
            if move is None:
                self._done = True
            else:
                t, index = move
                self._move = (t, self._choice[t])
                self._choice[t] = index

    def _cheapest_smaller(self, t: int, resource: str, per_shard: bool) -> int | None:
        """Index of table t's cheapest option using less of `resource` than its current one."""
        options = self._space[t]
        limit = _use(options[self._choice[t]], resource, per_shard) * (1 - 1e-9)
        for k, option in enumerate(options):  # sorted by total perf: first hit is cheapest
            if _use(option, resource, per_shard) < limit:
                return k
        return None

    def _memory_step(self, result: PartitionResult) -> bool:
        """Change choices so the next proposal needs less of the memory that fell short.

        1. The summed need exceeds the summed capacity (+ `memory_slack`): tables move to
           options using less of that memory (e.g. HBM -> UVM), cheapest extra time per byte
           first, until the excess is freed, without overflowing the other memory.
        2. Else (fragmentation) a table-/column-wise shard that found no rank moves, once per
           table, to its cheapest option that fits what some rank had left;
        3. or tables move as in 1 until the failed table's need is freed;
        4. else the failed table (or the biggest user) shrinks its largest shard.
        If the choices come back to an earlier state, `feedback` frees a doubling share of
        the memory instead. After `patience` memory steps, 2 and 3 give way to 3 freeing
        `2^(steps - patience)` times the failed table's need: a search that placed one more
        table per proposal would take as many proposals as there are tables. False if
        nothing can shrink, or if the summed need exceeds the summed capacity and no table
        can move to the other memory (no split or move between ranks lowers a sum)."""
        t, resource = result.failed_index, result.failed_resource or "hbm"
        if t is None:
            return False
        self._memory_steps += 1
        bulk = 2.0 ** max(0, self._memory_steps - self.patience)
        other = "ddr" if resource == "hbm" else "hbm"
        deficit = result.extra.get("deficit", {resource: 0.0, other: 0.0})
        rank_cap = result.extra.get("rank_capacity", {resource: math.inf})
        failed = result.proposal[t]
        fits_a_rank = _use(failed, resource, per_shard=True) <= rank_cap[resource]
        total = sum(_use(o, resource) for o in result.proposal)
        room = -deficit[other] - self.memory_slack * sum(_use(o, other) for o in result.proposal)
        excess = deficit[resource] + self.memory_slack * total
        if excess > 0 and fits_a_rank and self._shrink_many(resource, excess, room):
            return True  # the sum does not fit: move the cheapest bytes out
        if deficit[resource] > 0 and fits_a_rank:  # without the slack, or no plan
            return self._shrink_many(resource, deficit[resource], -deficit[other])
        if result.extra.get("device_pass") and t not in self._refitted and bulk == 1.0:
            index = self._fits_now(t, result.extra.get("free"))
            if index is not None:  # fragmentation: split or offload just this table
                self._refitted.add(t)
                self._choice[t] = index
                return True
        if fits_a_rank and self._shrink_many(resource, bulk * _use(failed, resource), room):
            return True
        for u in [t] + sorted(
            range(len(self._space)),
            reverse=True,
            key=lambda u: _use(self._space[u][self._choice[u]], resource),
        ):
            index = self._cheapest_smaller(u, resource, per_shard=u == t)
            if index is not None:
                self._choice[u] = index
                return True
        return False

    def _fits_now(self, t: int, free: List[Tuple[float, float]] | None) -> int | None:
        """Table t's cheapest other option whose largest shard fits the memory some rank had
        left when the placement failed (splitting or offloading just enough)."""
        if not free:
            return None
        room_h = max(h for h, _ in free)
        room_d = max(d for _, d in free)
        both = sorted(free, reverse=True)
        for k, option in enumerate(self._space[t]):
            if k == self._choice[t] or option.max_hbm > room_h or option.max_ddr > room_d:
                continue
            if any(option.max_hbm <= h and option.max_ddr <= d for h, d in both):
                return k
        return None

    def _shrink_many(self, resource: str, need: float, room_other: float) -> bool:
        """Move tables to options that use less of `resource` (e.g. HBM -> UVM) until `need`
        bytes are freed, cheapest time per byte first, adding at most `room_other` bytes of
        the other memory. False if nothing moved."""
        moves = []
        for t, choice in enumerate(self._choice):
            best = self._cheapest_saving(t, choice, resource)
            if best is not None:
                moves.append(best)
        moves.sort()
        freed = 0.0
        for _, saved, added, t, k in moves:
            if freed >= need:
                break
            if added > 0 and added > room_other:  # moves that add none always go
                continue
            self._choice[t] = k
            freed += saved
            room_other -= added
        return freed > 0

    def _cheapest_saving(
        self, t: int, choice: int, resource: str
    ) -> Tuple[float, float, float, int, int] | None:
        """(extra time per byte saved, bytes saved, bytes of the other memory added, t, k) of
        table t's option k that saves `resource` most cheaply from option `choice`; None if
        none saves any. Memoised: the memory search asks again for the many tables whose
        choice did not change since, which keeps each step linear in the tables."""
        key = (t, choice, resource)
        if key in self._savings:
            return self._savings[key]
        other = "ddr" if resource == "hbm" else "hbm"
        use, use_other = f"total_{resource}", f"total_{other}"  # attributes: no call per option
        options = self._space[t]
        current = options[choice]
        current_use, current_perf = getattr(current, use), current.total_perf
        best = None
        for k, option in enumerate(options):
            saved = current_use - getattr(option, use)
            if saved > 0:
                cost = max(0.0, option.total_perf - current_perf) / saved
                if best is None or cost < best[0]:
                    added = getattr(option, use_other) - getattr(current, use_other)
                    best = (cost, saved, added, t, k)
        self._savings[key] = best
        return best

    def _balance_move(self, best: PartitionResult) -> Tuple[int, int] | None:
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
                if (
                    k != self._choice[t]
                    and (t, k) not in self._tried
                    and (option.max_perf < share * (1 - 1e-6))
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

    def propose(self) -> List[ShardingOption] | None:
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
                logger.debug("grid search skipped: %d combinations > %d", total, self.max_proposals)
            self._grid: Iterator[Tuple[ShardingOption, ...]] = iter(())
        else:
            self._grid = itertools.product(*[_by_perf(options) for options in search_space])

    def propose(self) -> List[ShardingOption] | None:
        combo = next(self._grid, None)
        return None if combo is None else list(combo)

    def feedback(self, result: PartitionResult) -> None:
        pass
