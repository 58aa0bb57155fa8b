"""BucketIndex (recshard.modules.mc_bucket_index): every (key, tag) query finds the row a plain
dict of the same entries gives, with full buckets (the stash) and repeated keys."""

from __future__ import annotations

import torch

from recshard.modules.mc_bucket_index import SLOTS, BucketIndex


def _check(keys: torch.Tensor, tags: torch.Tensor, queries: torch.Tensor, qtags: torch.Tensor):
    rows = torch.randperm(keys.numel()) * 3 + 1
    index = BucketIndex(keys, tags, rows)
    want = {(k, t): r for k, t, r in zip(keys.tolist(), tags.tolist(), rows.tolist())}
    found, got = index.find(queries, qtags)
    for q, t, f, r in zip(queries.tolist(), qtags.tolist(), found.tolist(), got.tolist()):
        assert f == ((q, t) in want), (q, t)
        if f:
            assert r == want[(q, t)], (q, t)
    return index


def test_random_keys_overflow_into_the_stash() -> None:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(-(2**63), 2**63 - 1, (20_000,), generator=gen)
    tags = torch.randint(0, 5, (20_000,), generator=gen)
    misses = torch.randint(-(2**63), 2**63 - 1, (5_000,), generator=gen)
    queries = torch.cat([keys, misses, torch.tensor([0, -1, 2**63 - 1, -(2**63)])])
    qtags = torch.cat([tags, torch.randint(0, 5, (5_004,), generator=gen)])
    index = _check(keys, tags, queries, qtags)
    assert index.stash_size() > 0  # at load 1/2, some of the ~5,000 buckets overflow


def _keys_of_one_bucket(count: int) -> torch.Tensor:
    """`count` keys whose mixed values share their top 32 bits: one bucket at any size."""
    mix = 0x9E3779B97F4A7C15
    inverse = pow(mix, -1, 2**64)
    mixed = [((0x5EED << 32) | j) * inverse % 2**64 for j in range(count)]
    return torch.tensor([m - 2**64 if m >= 2**63 else m for m in mixed])


def test_repeated_keys_and_a_crowded_bucket() -> None:
    crowded = _keys_of_one_bucket(5 * SLOTS)
    keys = torch.cat([torch.full((3,), 12345), crowded, torch.tensor([0])])
    tags = torch.cat([torch.arange(3), torch.zeros(crowded.numel(), dtype=torch.int64)])
    tags = torch.cat([tags, torch.tensor([9])])
    index = _check(
        keys,
        tags,
        torch.cat([keys, torch.tensor([12345, 7, 1, 0])]),
        torch.cat([tags, torch.tensor([3, 1, 0, 0])]),
    )
    assert index.stash_size() >= 2 + 4 * SLOTS  # two repeats of 12345, the crowd past SLOTS
    _check(keys[:1], tags[:1], keys, tags)
    _check(crowded, torch.ones_like(crowded), crowded, torch.ones_like(crowded))


def test_empty_index_finds_nothing() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    queries = torch.tensor([0, 5, -(2**63)])  # -2**63 mixes to 0, the empty slots' key
    found, _ = BucketIndex(empty, empty, empty).find(queries, torch.tensor([0, 1, 0]))
    assert not bool(found.any())
