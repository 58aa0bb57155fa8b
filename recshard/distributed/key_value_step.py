"""Key-value tables' rows brought into their DRAM caches for a step, agreed by every rank.

A batch whose distinct rows of a shard do not fit its cache's free slots fails where that
shard lives, after the ids arrived, before the output dist. Raising there alone would leave the
other ranks waiting in the output dist for the collective timeout; so a module with key-value
tables in its plan (the same answer on every rank) fills every cache first and sends the
result in the input verdict's exchange (`recshard.comm.verdict`: an all-gather of 17 int64 per
rank). The rank that overflowed raises `ValueError(message)`, every other rank
`RuntimeError("rank R rejected its input: message")`, and nobody enters the output dist.
"""

from __future__ import annotations

from typing import Iterable, List

import torch

from recshard.comm.verdict import exchange_verdict
from recshard.lookup.grouped import GroupedLookup
from recshard.lookup.key_value import CacheOverflowError
from recshard.sharding.common import EmbeddingSharding
from recshard.sparse import KeyedJaggedTensor
from recshard.types import ShardingEnv


def prefetch_rows(shardings: Iterable[EmbeddingSharding], dist_input: List[KeyedJaggedTensor]):
    """Bring the rows `dist_input` reads into the key-value caches; raises
    `CacheOverflowError` on this rank alone."""
    for sharding, features in zip(shardings, dist_input):
        if isinstance(sharding.lookup, GroupedLookup):
            sharding.lookup.prefetch(features)


def fill_caches_agreed(
    env: ShardingEnv,
    device: torch.device,
    shardings: Iterable[EmbeddingSharding],
    dist_input: List[KeyedJaggedTensor],
) -> None:
    """`prefetch_rows`, then every rank raises if any rank's rows did not fit."""
    error = None
    try:
        prefetch_rows(shardings, dist_input)
    except CacheOverflowError as e:
        error = str(e)
    verdict = exchange_verdict(env.pg, error, device)
    if verdict is not None:
        verdict.wait()
    elif error is not None:
        raise CacheOverflowError(error)
