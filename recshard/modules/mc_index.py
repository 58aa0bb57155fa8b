"""The ids holding rows of a managed collision module, sorted, with their rows: what a remap
searches. Derived from the module's state (`_mch_raw_ids`, checked by `check_rows`): rebuilt
after a load, updated by a merge (not a sort) when an eviction hands rows to new ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Protocol, Tuple, runtime_checkable

import torch

from recshard.modules.mc_base import FREE
from recshard.modules.mc_compete import merge_sorted


class IdIndex(Protocol):
    """What a module asks of its id index (`SortedIdIndex` here; a C++ hash in
    `recshard.distributed.mc_native`): `epoch` changes whenever the ids held do."""

    epoch: int

    def __len__(self) -> int: ...

    def rebuild(self, raw_ids: torch.Tensor, row_offset: int) -> None: ...

    def replace(self, old_ids: torch.Tensor, new_ids: torch.Tensor, rows: torch.Tensor) -> None: ...

    def find(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class LfuEviction:
    """What a module's LFU eviction (no threshold filter) reads and writes, as an
    `LfuEvictingIndex` runs it: the ids seen since the last one (`ids [N]`), the module's
    `raw_ids [R]` and `counts [R]` (written in place), its local `bucket_starts [B + 1]` (on
    the host), `buckets`, `first_bucket` and `row_offset` (rows global: local + offset)."""

    ids: torch.Tensor
    raw_ids: torch.Tensor
    counts: torch.Tensor
    bucket_starts: torch.Tensor
    buckets: int
    first_bucket: int
    row_offset: int


@runtime_checkable
class LfuEvictingIndex(IdIndex, Protocol):
    """An index that also runs a module's whole LFU eviction (no threshold filter) in one call
    (`recshard.distributed.mc_native.NativeIdIndex.evict_lfu`): same rows, ids and counts as
    `MCHManagedCollisionModule`'s torch path; returns (global rows that changed hands, sorted;
    how many of them had been held)."""

    def evict_lfu(self, eviction: LfuEviction) -> Tuple[torch.Tensor, int]: ...


class SortedIdIndex:
    """`ids [H]` (sorted) and their global `rows [H]`; `epoch` changes whenever they do."""

    def __init__(self, device: torch.device) -> None:
        self.ids = torch.empty(0, dtype=torch.int64, device=device)
        self.rows = torch.empty(0, dtype=torch.int64, device=device)
        self.epoch = 0

    def __len__(self) -> int:
        return self.ids.numel()

    @torch.no_grad()
    def rebuild(self, raw_ids: torch.Tensor, row_offset: int) -> None:
        """From the id held by each local row (`raw_ids [R]`, `FREE` if none)."""
        held = (raw_ids != FREE).nonzero().squeeze(1)
        ids = raw_ids[held]
        order = torch.argsort(ids)
        self.ids, self.rows = ids[order], held[order] + row_offset
        self.epoch += 1

    @torch.no_grad()
    def replace(self, old_ids: torch.Tensor, new_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """`old_ids` (each in the index) leave it; `new_ids` come in at global `rows`."""
        keep = torch.ones_like(self.ids, dtype=torch.bool)
        keep[torch.searchsorted(self.ids, old_ids)] = False
        self.ids, self.rows = merge_sorted(self.ids[keep], self.rows[keep], new_ids, rows)
        self.epoch += 1

    def find(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(whether each id `[N]` holds a row, its global row where it does: `[N]` each; the
        other entries are rows of other ids). The index must not be empty."""
        position = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
        return self.ids[position] == ids, self.rows[position]


@torch.no_grad()
def check_rows(
    raw: torch.Tensor,
    bucket_starts: List[int],
    buckets: int,
    first_bucket: int,
    input_hash_size: int,
    label: str,
) -> None:
    """ValueError unless `raw [R]` (the id holding each local row, `FREE` if none) gives each
    id one row, of its bucket (`id % buckets`; local buckets start at `first_bucket`, their
    rows at `bucket_starts`), not a bucket's reserved last row, ids in `[0, input_hash_size)`."""
    held = (raw != FREE).nonzero().squeeze(1)
    ids = raw[held]
    if ids.numel() != ids.unique().numel():
        raise ValueError(f"{label}: the loaded state gives an id more than one row")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= input_hash_size):
        raise ValueError(f"{label}: the loaded state holds ids outside input_hash_size")
    ends = torch.tensor(bucket_starts[1:], dtype=torch.int64, device=raw.device)
    if not torch.equal(ids % buckets - first_bucket, torch.bucketize(held, ends, right=True)):
        raise ValueError(
            f"{label}: the loaded state places ids outside the rows of their bucket "
            f"(saved with another `buckets` than {buckets}?)"
        )
    if bool((raw[ends - 1] != FREE).any()):
        raise ValueError(f"{label}: the loaded state gives a bucket's reserved row to an id")
