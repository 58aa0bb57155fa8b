"""The MCH module's eviction step: the ids seen since the last eviction update the metadata of
the rows they hold or compete for their bucket's rows (`recshard.modules.mc_compete`); an LFU
policy without a threshold filter runs it in one call of an index that can
(`LfuEvictingIndex`; `lfu_eviction` / `lfu_evicted` let a sharded collection run all its
modules' in one call). A mixin of `MCHManagedCollisionModule`, which supplies the state read
and written here (see `recshard.modules.mc_modules`)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn

from recshard.modules.mc_base import FREE
from recshard.modules.mc_compete import bucket_contest, threshold_passed
from recshard.modules.mc_eviction import COUNTS, LAST_ACCESS
from recshard.modules.mc_history import IDS, SEEN_AT, coalesce
from recshard.modules.mc_index import LfuEvictingIndex, LfuEviction


class MCHEvictionStep(nn.Module):
    """Eviction of `MCHManagedCollisionModule` (see the module docstring)."""

    def _local_bucket(self, ids: torch.Tensor) -> torch.Tensor:
        if self._buckets == 1:
            return torch.zeros_like(ids)
        return ids % self._buckets - self._bucket_range[0]

    @torch.no_grad()
    def _coalesce_and_evict(self, current_iter: int) -> None:
        """The ids seen since the last eviction update the metadata of the rows they hold, or
        compete for their bucket's rows; the sorted index is updated in place (merged)."""
        if not len(self._history):
            return
        in_one_call = self.lfu_eviction()
        if in_one_call is not None:
            index, eviction = in_one_call
            self.lfu_evicted(*index.evict_lfu(eviction))
            return
        views = self._history.views()
        unique, counts, last = coalesce(views[IDS], views.get(SEEN_AT))
        seen = {COUNTS: counts}
        if last is not None:
            seen[LAST_ACCESS] = last
        self._history.clear()
        self._sync_history()
        bucket = self._local_bucket(unique)
        passed = threshold_passed(self._eviction_policy.threshold_filtering_func, bucket, counts)
        if passed is not None:
            unique, bucket = unique[passed], bucket[passed]
            seen = {name: v[passed] for name, v in seen.items()}
        if len(self._index):
            hit, rows = self._index.find(unique)
            hit_rows = rows[hit] - self._row_offset
            for name, buffer in self.metadata().items():
                if name == COUNTS:
                    buffer[hit_rows] += seen[COUNTS][hit]
                else:
                    buffer[hit_rows] = seen[name][hit]
            new = ~hit
            unique, bucket = unique[new], bucket[new]
            seen = {name: v[new] for name, v in seen.items()}
        if unique.numel() == 0:
            return
        changes = [
            self._compete(b, current_iter, unique[mine], {n: v[mine] for n, v in seen.items()})
            for b in torch.unique(bucket).tolist()
            for mine in [bucket == b]
        ]
        rows = torch.cat([rows for rows, _ in changes])
        if rows.numel():
            self._replace_ids(rows, torch.cat([new_ids for _, new_ids in changes]))

    def lfu_eviction(self) -> Tuple[LfuEvictingIndex, LfuEviction] | None:
        """This iteration's eviction as one call of the module's `LfuEvictingIndex`
        (`use_kernels`, LFU without a threshold filter): (the index, what it evicts from), to
        be followed by `lfu_evicted`. None when the torch path runs it or nothing was seen."""
        if self._lfu_index is None or not len(self._history):
            return None
        index, bucket_starts = self._lfu_index
        buffers = self._buffers  # not nn.Module.__getattr__: this runs per module and step
        eviction = LfuEviction(
            self._history.views()[IDS],
            buffers["_mch_raw_ids"],
            buffers[f"_mch_{COUNTS}"],
            bucket_starts,
            self._buckets,
            self._bucket_range[0],
            self._row_offset,
        )
        return index, eviction

    def lfu_evicted(self, rows: torch.Tensor, evicted: int) -> None:
        """After the index ran `lfu_eviction` (`rows`: global rows that changed hands, sorted;
        `evicted`: of them, those held before): the history starts anew, the counters count
        them, the rows wait for `evict`."""
        self._history.clear()
        self._sync_history()
        self._counters["admitted"] += rows.numel()
        self._counters["evicted"] += evicted
        if rows.numel():
            self._evicted_rows.append(rows)

    def _compete(
        self, bucket: int, current_iter: int, ids: torch.Tensor, seen: Dict[str, torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """New ids of one bucket (`[M]`, sorted, holding no row) compete for its rows (all but
        its reserved last row). Returns (local rows given to new ids, those ids); metadata
        written here, ids by `_replace_ids`."""
        start = self._bucket_starts[bucket]
        slots = self._bucket_starts[bucket + 1] - 1 - start
        meta = {n: b[start : start + slots] for n, b in self.metadata().items()}
        held = self._mch_raw_ids[start : start + slots]
        lost, won, won_meta = bucket_contest(
            self._eviction_policy, current_iter, held, meta, ids, seen, self._label, self._ranking
        )
        self._counters["admitted"] += lost.numel()
        self._counters["evicted"] += int((held[lost] != FREE).sum())
        for name, buffer in meta.items():
            buffer[lost] = won_meta[name]
        return start + lost, won

    @torch.no_grad()
    def _replace_ids(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Local `rows` now hold `ids`: the state, the sorted index (merged, not rebuilt) and
        the rows to reset."""
        global_rows = rows + self._row_offset
        old_ids = self._mch_raw_ids[rows]
        self._index.replace(old_ids[old_ids != FREE], ids, global_rows)
        self._mch_raw_ids[rows] = ids
        self._index_version = self._mch_raw_ids._version
        self._evicted_rows.append(global_rows.sort().values)
