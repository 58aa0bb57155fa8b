"""A pure-Python reference of managed collision (ZCH) with eviction, for the tests.

Plain dicts and sorted(): per bucket a list of slots (raw id or None) with the policy's
metadata; every `interval` training steps the ids seen since the last eviction update their
slots or compete for them, ranked by score (ties: held ids before new ones, held ids by raw id,
new ids by count then id). The bucket's last row is reserved for ids without a row.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, List, Tuple


def bucket_starts(zch_size: int, buckets: int) -> List[int]:
    base, extra = divmod(zch_size, buckets)
    return [b * base + min(b, extra) for b in range(buckets + 1)]


class ReferenceZCH:
    def __init__(
        self, zch_size: int, buckets: int, interval: int, policy: str, decay: float = 1.0
    ) -> None:
        self.starts = bucket_starts(zch_size, buckets)
        self.buckets, self.interval, self.policy, self.decay = buckets, interval, policy, decay
        self.ids: List[int | None] = [None] * zch_size
        self.counts = [0] * zch_size
        self.last = [0] * zch_size
        self.iter = 0
        self.history: List[Tuple[int, int]] = []
        self.evicted: List[int] = []

    def row_of(self, raw: int) -> int:
        b = raw % self.buckets
        for row in range(self.starts[b], self.starts[b + 1] - 1):
            if self.ids[row] == raw:
                return row
        return self.starts[b + 1] - 1

    def score(self, count: int, last: int) -> float:
        distance = math.pow(self.iter - last + 1, self.decay)
        if self.policy == "lfu":
            return float(count)
        if self.policy == "lru":
            return -distance
        return count / distance

    def step(self, ids: List[int], training: bool = True) -> List[int]:
        if training:
            self.iter += 1
            self.history += [(i, self.iter) for i in ids]
            if self.iter % self.interval == 0:
                self._evict()
        return [self.row_of(i) for i in ids]

    def _evict(self) -> None:
        counts = Counter(i for i, _ in self.history)
        last: Dict[int, int] = {}
        for i, it in self.history:
            last[i] = max(last.get(i, 0), it)
        self.history = []
        for b in range(self.buckets):
            self._compete(b, {i: c for i, c in counts.items() if i % self.buckets == b}, last)

    def _compete(self, b: int, counts: Dict[int, int], last: Dict[int, int]) -> None:
        rows = list(range(self.starts[b], self.starts[b + 1] - 1))
        if not rows or not counts:
            return
        new = []
        for raw in sorted(counts):
            held = [r for r in rows if self.ids[r] == raw]
            if held:
                self.counts[held[0]] += counts[raw]
                self.last[held[0]] = last[raw]
            else:
                new.append(raw)
        new.sort(key=lambda raw: -counts[raw])  # stable over sorted ids
        inf = float("inf")
        existing = sorted(rows, key=lambda r: (inf if self.ids[r] is None else self.ids[r], r))
        entries = [("row", r, self.score(self.counts[r], self.last[r])) for r in existing]
        entries += [("new", raw, self.score(counts[raw], last[raw])) for raw in new]
        ranked = sorted(range(len(entries)), key=lambda k: -entries[k][2])
        top, rest = ranked[: len(rows)], ranked[len(rows) :]
        evicted = [entries[k][1] for k in rest if entries[k][0] == "row"]
        admitted = [entries[k][1] for k in top if entries[k][0] == "new"]
        assert len(evicted) == len(admitted)
        for row, raw in zip(evicted, admitted):
            self.ids[row], self.counts[row], self.last[row] = raw, counts[raw], last[raw]
            self.evicted.append(row)
