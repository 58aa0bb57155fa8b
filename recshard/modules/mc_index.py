"""The ids holding rows of a managed collision module, sorted, with their rows: what a remap
searches. Derived from the module's state (`_mch_raw_ids`): rebuilt after a load, updated by a
merge (not a sort) when an eviction hands rows to new ids.
"""

from __future__ import annotations

from typing import Tuple

import torch

from recshard.modules.mc_base import FREE
from recshard.modules.mc_compete import merge_sorted


class SortedIdIndex:
    """`ids [H]` (sorted) and their global `rows [H]`; `epoch` changes whenever they do."""

    def __init__(self, device: torch.device) -> None:
        self.ids = torch.empty(0, dtype=torch.int64, device=device)
        self.rows = torch.empty(0, dtype=torch.int64, device=device)
        self.epoch = 0

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
