"""The eviction contest's selection (recshard.modules.mc_compete) against a full sort of the
bucket, on scores with many ties, free rows and held rows."""

from __future__ import annotations

import torch

from recshard.modules.mc_base import FREE
from recshard.modules.mc_compete import lowest_ranked, merge_sorted


def _full_ranking(scores: torch.Tensor, raw_ids: torch.Tensor) -> list:
    """Rows by (score descending, held rows by raw id, then free rows by row)."""
    rows = range(scores.numel())
    entry = sorted(rows, key=lambda r: (int(raw_ids[r]), r))
    position = {row: k for k, row in enumerate(entry)}
    return sorted(rows, key=lambda r: (-float(scores[r]), position[r]))


def test_lowest_ranked_equals_the_tail_of_a_full_sort() -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        size = int(torch.randint(1, 40, (1,), generator=gen))
        scores = torch.randint(0, 4, (size,), generator=gen).double()
        raw_ids = torch.randperm(1000, generator=gen)[:size]
        raw_ids[torch.rand(size, generator=gen) < 0.3] = FREE
        k = int(torch.randint(1, size + 1, (1,), generator=gen))
        want = _full_ranking(scores, raw_ids)[size - k :]
        assert lowest_ranked(scores, raw_ids, k).tolist() == want, trial


def test_merge_sorted_keeps_keys_sorted_with_their_values() -> None:
    keys, values = torch.tensor([2, 5, 9]), torch.tensor([20, 50, 90])
    merged = merge_sorted(keys, values, torch.tensor([7, 1, 10]), torch.tensor([70, 10, 100]))
    assert merged[0].tolist() == [1, 2, 5, 7, 9, 10]
    assert merged[1].tolist() == [10, 20, 50, 70, 90, 100]
