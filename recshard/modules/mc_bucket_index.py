"""A read-mostly hash index of int64 keys, each with a (tag, row): what `FusedRemap` searches.

Why not `searchsorted`: a binary search over a few hundred thousand sorted keys touches a
cache line at each of its last ~8 steps, for every query (on CPU it was the largest op of
the managed collision step). Here a query reads one bucket of `SLOTS` keys (one 64-byte line)
and one (tag, row) pair: a fixed dozen vectorized ops, no probing rounds.

Layout: each key is mixed (`key * odd constant`, a bijection) and its top 32 bits pick one
of `B = ceil(H / (SLOTS / 2))` buckets (load about one half). A bucket holds its first
`SLOTS` distinct keys; the rest of a full bucket's keys, and every repeat of a key already
placed (two tables' salted ids may meet), go to a small sorted stash, searched only by the
queries that need it (their bucket overflowed, or their key matched with another tag).
Built from scratch (one sort) whenever the keys change; between changes it is read only.
"""

from __future__ import annotations

from typing import Tuple

import torch

SLOTS = 8
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd, so `key * _MIX` is a bijection
_SIGN = -(2**63)


def _mixed(keys: torch.Tensor) -> torch.Tensor:
    """`keys * _MIX` with its sign bit flipped: sorted as signed int64, the mixed keys are in
    the unsigned order of their top 32 bits, which pick the bucket."""
    return (keys * _MIX) ^ _SIGN


class BucketIndex:
    """Keys `[H]` (int64, repeats allowed) with `tags [H]` (>= 0) and `rows [H]`."""

    def __init__(self, keys: torch.Tensor, tags: torch.Tensor, rows: torch.Tensor) -> None:
        count = keys.numel()
        self._buckets = max(1, -(-2 * count // SLOTS))
        mixed = _mixed(keys)
        order = torch.argsort(mixed)
        mixed = mixed.index_select(0, order)
        tags, rows = tags.index_select(0, order), rows.index_select(0, order)
        bucket = self._bucket(mixed)
        first = torch.ones_like(mixed, dtype=torch.bool)
        first[1:] = mixed[1:] != mixed[:-1]  # equal keys lie side by side, in one bucket
        per_bucket = torch.zeros(self._buckets, dtype=torch.int64, device=keys.device)
        per_bucket.index_add_(0, bucket, first.to(torch.int64))
        before = per_bucket.cumsum(0) - per_bucket
        slot = first.cumsum(0) - 1 - before.index_select(0, bucket)
        placed = first & (slot < SLOTS)
        kept = placed.nonzero().squeeze(1)
        at = (bucket * SLOTS + slot).index_select(0, kept)
        size = self._buckets * SLOTS
        self._keys = mixed.new_zeros(size).index_copy_(0, at, mixed.index_select(0, kept))
        self._keys = self._keys.view(self._buckets, SLOTS)
        # an empty slot's tag is -1: no query's (1-D gathers: faster than one of [N, 2] rows)
        self._tags = tags.new_full((size,), -1).index_copy_(0, at, tags.index_select(0, kept))
        self._rows = rows.new_zeros(size).index_copy_(0, at, rows.index_select(0, kept))
        self._overflowed = per_bucket > SLOTS
        stashed = (~placed).nonzero().squeeze(1)
        self._stash_keys = mixed.index_select(0, stashed)  # still sorted
        self._stash_tags = tags.index_select(0, stashed)
        self._stash_rows = rows.index_select(0, stashed)
        self._window = 0
        if self._stash_keys.numel():
            repeats = torch.unique_consecutive(self._stash_keys, return_counts=True)[1]
            self._window = int(repeats.max())

    def _bucket(self, mixed: torch.Tensor) -> torch.Tensor:
        high = (mixed >> 32) + (1 << 31)  # in [0, 2**32), in the order of `mixed`
        return (high * self._buckets) >> 32

    def stash_size(self) -> int:
        """Keys kept in the stash (past a full bucket, or repeats)."""
        return int(self._stash_keys.numel())

    def find(self, keys: torch.Tensor, tags: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(whether each query `(keys [N], tags [N])` is in the index, its row where it is:
        `[N]` each; the other rows are unspecified)."""
        mixed = _mixed(keys)
        bucket = self._bucket(mixed)
        equal = self._keys.index_select(0, bucket) == mixed.unsqueeze(1)  # [N, SLOTS]
        key_found = equal.any(1)
        slot = equal.to(torch.uint8).argmax(1)  # the first equal key: a placed one
        at = bucket * SLOTS + slot
        found = key_found & (self._tags.index_select(0, at) == tags)
        rows = self._rows.index_select(0, at)
        if self._window:
            stash = ~found & (key_found | self._overflowed.index_select(0, bucket))
            ask = stash.nonzero().squeeze(1)
            if ask.numel():
                hit, at = self._find_in_stash(mixed.index_select(0, ask), tags.index_select(0, ask))
                found[ask] = hit
                rows[ask] = torch.where(hit, at, rows.index_select(0, ask))
        return found, rows

    def _find_in_stash(
        self, mixed: torch.Tensor, tags: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        last = self._stash_keys.numel() - 1
        position = torch.searchsorted(self._stash_keys, mixed)
        found = torch.zeros_like(tags, dtype=torch.bool)
        rows = torch.zeros_like(tags)
        for step in range(self._window):
            at = (position + step).clamp_(max=last)
            hit = (self._stash_keys.index_select(0, at) == mixed) & (
                self._stash_tags.index_select(0, at) == tags
            )
            rows = torch.where(hit, self._stash_rows.index_select(0, at), rows)
            found |= hit
        return found, rows
