"""One bucket's eviction contest, in linear passes over its rows (no sort of the whole bucket).

The contest ranks every entry by score, highest first, ties by entry order: the bucket's rows
ordered by the raw id they hold (free rows last, by row), then the new ids by count (highest
first, ties by id), as `tests/modules/mc_reference.py` spells out in plain Python. The first
`slots` entries keep or get a row; the rest lose it. Only the `K = min(new, slots)`
lowest-ranked rows can lose theirs, so those are found with a selection (`kthvalue`, `topk`)
and only they and the new ids are sorted.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from recshard.modules.mc_base import FREE
from recshard.modules.mc_eviction import COUNTS, MCHEvictionPolicy, ThresholdFilter


def lowest_ranked(scores: torch.Tensor, raw_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the `k` lowest-ranked of a bucket's rows (`scores [S]`, `raw_ids [S]`: the
    id each holds, `FREE` if none), in rank order (highest first)."""
    free = raw_ids == FREE
    if k <= 0:  # no new id: no row to choose (kthvalue has no 0th)
        return torch.arange(0, device=scores.device)
    if k >= scores.numel():
        chosen = torch.arange(scores.numel(), device=scores.device)
    else:
        threshold = torch.kthvalue(scores, k).values
        below = (scores < threshold).nonzero().squeeze(1)
        tied = scores == threshold
        need = k - below.numel()
        # of the tied, the latest entries rank lowest: free rows (the last by row), then held
        # rows by raw id, highest first
        tied_free = (tied & free).nonzero().squeeze(1)
        parts = [below, tied_free[max(tied_free.numel() - need, 0) :]]
        if need > tied_free.numel():
            tied_held = (tied & ~free).nonzero().squeeze(1)
            top = torch.topk(raw_ids[tied_held], need - tied_free.numel()).indices
            parts.append(tied_held[top])
        chosen = torch.cat(parts)
    held = chosen[~free[chosen]]
    by_entry = torch.cat([held[torch.argsort(raw_ids[held])], chosen[free[chosen]].sort().values])
    return by_entry[torch.argsort(scores[by_entry], descending=True, stable=True)]


def contest(
    row_scores: torch.Tensor, new_scores: torch.Tensor, slots: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """`row_scores [K]` (candidate rows, in rank order) against `new_scores [M]` (new ids, in
    entry order) for all but `slots - K` of a bucket's rows. Returns (positions in the candidates
    of the rows that lose theirs, positions in the new ids of the ids that get them), paired in
    rank order."""
    k = row_scores.numel()
    ranked = torch.argsort(torch.cat([row_scores, new_scores]), descending=True, stable=True)
    kept, dropped = ranked[:k], ranked[k:]
    return dropped[dropped < k], kept[kept >= k] - k


# (row scores [S], the ids holding the rows [S], new ids' scores [M] in entry order) ->
# (rows that lose theirs, new ids that get them: positions, paired in rank order)
Contest = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def _nan_lowest(scores: torch.Tensor) -> torch.Tensor:
    """`scores` with NaN as -inf (the selections and sorts below need a total order)."""
    if not scores.is_floating_point():
        return scores
    return scores.masked_fill(scores.isnan(), -float("inf"))


def rank_contest(
    row_scores: torch.Tensor, held: torch.Tensor, new_scores: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A bucket's `S` rows against `M` new ids (see the module doc): positions of the rows
    that lose theirs and of the new ids that get them, paired in rank order. A NaN score ranks
    as -inf (a row scored NaN is among the first to lose, a new id scored NaN wins no row), so
    the order is defined. (The C++ twin: `recshard.distributed.mc_native.native_contest`.)"""
    row_scores, new_scores = _nan_lowest(row_scores), _nan_lowest(new_scores)
    candidates = lowest_ranked(row_scores, held, min(new_scores.numel(), held.numel()))
    lose, win = contest(row_scores[candidates], new_scores, held.numel())
    return candidates[lose], win


def merge_sorted(
    keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two key-sorted arrays (with a value per key) merged into one, in O(len) passes."""
    order = torch.argsort(new_keys)
    new_keys, new_values = new_keys[order], new_values[order]
    total = keys.numel() + new_keys.numel()
    at = torch.searchsorted(keys, new_keys) + torch.arange(new_keys.numel(), device=keys.device)
    old = torch.ones(total, dtype=torch.bool, device=keys.device)
    old[at] = False
    merged_keys = torch.empty(total, dtype=keys.dtype, device=keys.device)
    merged_values = torch.empty(total, dtype=values.dtype, device=keys.device)
    merged_keys[at], merged_values[at] = new_keys, new_values
    merged_keys[old], merged_values[old] = keys, values
    return merged_keys, merged_values


def bucket_contest(
    policy: MCHEvictionPolicy,
    current_iter: int,
    held: torch.Tensor,
    meta: Dict[str, torch.Tensor],
    ids: torch.Tensor,
    seen: Dict[str, torch.Tensor],
    label: str,
    ranking: Contest = rank_contest,
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """New ids of one bucket (`ids [M]`, sorted, holding no row; `seen`: their metadata, each
    `[M]`) against the ids holding its `S` rows (`held [S]`, `FREE` if none; `meta`: the rows'
    metadata), ranked by `ranking`. Returns (positions `[K]` of the rows that change hands, the
    ids `[K]` that get them, those ids' metadata), paired."""
    slots = held.numel()
    if slots == 0:
        return ids[:0], ids[:0], {n: v[:0] for n, v in seen.items()}
    by_count = torch.argsort(seen[COUNTS], descending=True, stable=True)
    new_ids = ids[by_count]
    new_meta = {name: seen[name][by_count] for name in meta}
    row_scores = policy.eviction_scores(current_iter, meta)
    lose, win = ranking(row_scores, held, policy.eviction_scores(current_iter, new_meta))
    if lose.numel() != win.numel():
        raise RuntimeError(f"{label}: eviction paired {lose.numel()} rows with {win.numel()} ids")
    return lose, new_ids[win], {n: v[win] for n, v in new_meta.items()}


def threshold_passed(
    threshold: ThresholdFilter | None, bucket: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor | None:
    """Mask of the ids (`counts [U]`, in buckets `bucket [U]`) a policy's threshold filter lets
    through, bucket by bucket; None without a filter."""
    if threshold is None:
        return None
    passed = torch.zeros_like(counts, dtype=torch.bool)
    for b in torch.unique(bucket).tolist():
        mine = bucket == b
        passed[mine] = threshold(counts[mine])[0]
    return passed
