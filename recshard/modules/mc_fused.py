"""Remap the ids of several managed collision modules at once: one index over all of
them, so a batch of any number of tables costs a fixed number of tensor ops, not a loop.

Each module's ids are salted with its own 63-bit constant (`id ^ salt[table]`, a bijection
per table) and kept in one `BucketIndex` (`recshard.modules.mc_bucket_index`) with their
table and local row. A query is found by its salted id and confirmed by its table tag (two
tables' salted ids may meet). The index is rebuilt when a module's own index changes (an
eviction or a loaded state); between evictions it is read only.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from recshard.modules.mc_base import ManagedCollisionModule
from recshard.modules.mc_bucket_index import BucketIndex

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_LOW63 = (1 << 63) - 1


def table_salts(tables: int, device: torch.device) -> torch.Tensor:
    """The 63-bit salt of each of `tables` tables `[tables]` on `device` (multiples of the
    golden ratio: distinct, and a bijection of ids per table under XOR)."""
    return (torch.arange(1, tables + 1, dtype=torch.int64, device=device) * _GOLDEN) & _LOW63


class FusedRemap:
    """Local rows of ids of several MCH modules (`recshard.modules.mc_modules`), by table."""

    def __init__(self, modules: Sequence[ManagedCollisionModule], device: torch.device) -> None:
        self._modules = list(modules)
        tables = len(self._modules)
        self._salts = table_salts(tables, device)
        defaults = [m.default_rows() for m in self._modules]  # type: ignore[attr-defined]
        self._defaults = torch.cat(defaults).to(device)
        starts = [0] + [d.numel() for d in defaults[:-1]]
        self._default_start = torch.tensor(starts, dtype=torch.int64, device=device).cumsum(0)
        self._buckets = torch.tensor([m.buckets() for m in self._modules], device=device)
        self._first_bucket = torch.tensor(
            [m.bucket_range()[0] for m in self._modules],  # type: ignore[attr-defined]
            device=device,
        )
        self._one_bucket_each = all(d.numel() == 1 for d in defaults)
        # each module's lookup counters become a row of one tensor, counted here in one op
        self._counts = torch.zeros(tables, 2, dtype=torch.int64, device=device)
        for t, m in enumerate(self._modules):
            self._counts[t] = m._lookup_counts  # type: ignore[attr-defined]
            m._lookup_counts = self._counts[t]  # type: ignore[attr-defined]
        self._epochs: List[int] = []
        self._held = 0
        self._index = BucketIndex(*(torch.empty(0, dtype=torch.int64, device=device),) * 3)

    def _refresh(self) -> None:
        epochs = [m.index_epoch() for m in self._modules]  # type: ignore[attr-defined]
        if epochs == self._epochs:
            return
        indexes = [m.sorted_index() for m in self._modules]  # type: ignore[attr-defined]
        sizes = torch.tensor([ids.numel() for ids, _, _ in indexes], device=self._salts.device)
        tags = torch.repeat_interleave(torch.arange(len(indexes), device=sizes.device), sizes)
        keys = torch.cat([ids for ids, _, _ in indexes]) ^ self._salts.index_select(0, tags)
        self._held = keys.numel()
        self._index = BucketIndex(keys, tags, torch.cat([rows for _, rows, _ in indexes]))
        self._epochs = epochs

    def remap(self, ids: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Local row `[N]` of each id `[N]` in its table's module (`tables [N]`: module index;
        each id of that module's buckets): its row, or its bucket's reserved row.

        Gathers are `index_select` (several times faster than `tensor[index]` on CPU)."""
        self._refresh()
        if self._one_bucket_each:
            rows = self._defaults.index_select(0, tables)
        else:
            bucket = ids % self._buckets.index_select(0, tables) - self._first_bucket.index_select(
                0, tables
            )
            rows = self._defaults.index_select(
                0, self._default_start.index_select(0, tables) + bucket
            )
        self._counts[:, 0] += torch.bincount(tables, minlength=len(self._modules))
        if self._held == 0:
            return rows
        found, held_rows = self._index.find(ids ^ self._salts.index_select(0, tables), tables)
        self._counts[:, 1].index_add_(0, tables, found.to(torch.int64))
        return torch.where(found, held_rows, rows)
