"""A managed collision module's history: the ids it counted since its last eviction, in arrival
order, each with the iteration it was seen at (TorchRec's `_history_accumulator` and
`_history_<metadata>`). The eviction coalesces it (`coalesce`) and starts a new one.

Here the history is state (persistent buffers), so a checkpoint taken between evictions resumes
exactly. Its length counts entries, not rows: a sharded state dict concatenates the ranks'
histories, and a load keeps the entries of the module's buckets (`entry_state_names` /
`load_entry_state` of `MCHManagedCollisionModule`; `recshard.distributed.sharded_state`).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

IDS = "_history_accumulator"
SEEN_AT = "_history_last_access_iter"


class History:
    """Append-only `[N]` arrays with spare room (amortized O(1) per appended id): `IDS`, and
    `SEEN_AT` when the policy keeps last access. `views()` are what the module registers."""

    def __init__(self, names: List[str], device: torch.device) -> None:
        self._storage = {n: torch.empty(0, dtype=torch.int64, device=device) for n in names}
        self._used = 0

    def names(self) -> List[str]:
        return list(self._storage)

    def __len__(self) -> int:
        return self._used

    def views(self) -> Dict[str, torch.Tensor]:
        return {n: s[: self._used] for n, s in self._storage.items()}

    def append(self, ids: torch.Tensor, iteration: int) -> None:
        """Ids `[N]` (int64: no autograd to switch off) seen at `iteration`."""
        count = ids.numel()
        self.reserve(count)
        for name, storage in self._storage.items():
            part = storage.narrow(0, self._used, count)
            if name == IDS:
                part.copy_(ids)
            else:
                part.fill_(iteration)
        self._used += count

    def reserve(self, count: int) -> None:
        """Room for `count` more entries in every array (grown to twice what is needed when
        short, at least 1024: rarely)."""
        end = self._used + count
        for name, storage in self._storage.items():
            if end > storage.numel():
                grown = torch.empty(max(2 * end, 1024), dtype=torch.int64, device=storage.device)
                grown[: self._used] = storage[: self._used]
                self._storage[name] = grown

    def arrays(self) -> Tuple[torch.Tensor, torch.Tensor | None]:
        """The whole arrays, spare room included (`IDS`'s, `SEEN_AT`'s if kept), for a writer
        that fills entries `[len(self), ...)` after `reserve` and then calls `advance`."""
        return self._storage[IDS], self._storage.get(SEEN_AT)

    def advance(self, count: int) -> None:
        """`count` entries past the end, written into `arrays()`, now belong to the history."""
        if self._used + count > self._storage[IDS].numel():
            raise RuntimeError(f"a history of {self._used} entries cannot take {count} more")
        self._used += count

    def clear(self) -> None:
        self._used = 0

    def reset(self, values: Dict[str, torch.Tensor]) -> None:
        """Replace the history by `values` (`{name: [N]}`, every name of this history)."""
        self._storage = {n: values[n].to(torch.int64).clone() for n in self._storage}
        self._used = values[IDS].numel()


def coalesce(
    ids: torch.Tensor, seen_at: torch.Tensor | None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(unique ids, sorted; how often each was seen; the last iteration it was seen at, if
    `seen_at` is given): `[U]` each."""
    unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    if seen_at is None:
        return unique, counts, None
    last = torch.zeros_like(unique).scatter_reduce_(0, inverse, seen_at, "amax", include_self=False)
    return unique, counts, last


def check_history(
    values: Dict[str, torch.Tensor], names: List[str], input_hash_size: int, label: str
) -> None:
    """ValueError unless `values` is a history with these `names`: int64 `[N]` each, ids in
    `[0, input_hash_size)`, iterations from 1."""
    if sorted(values) != sorted(names):
        raise ValueError(f"{label}: a history has {sorted(names)}, got {sorted(values)}")
    ids = values[IDS]
    for name, value in values.items():
        if value.dim() != 1 or value.dtype != torch.int64 or value.numel() != ids.numel():
            raise ValueError(
                f"{label}: history '{name}' must be int64 [{ids.numel()}], got "
                f"{value.dtype} {tuple(value.shape)}"
            )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= input_hash_size):
        raise ValueError(f"{label}: the loaded history holds ids outside input_hash_size")
    if SEEN_AT in values and values[SEEN_AT].numel() and int(values[SEEN_AT].min()) < 1:
        raise ValueError(f"{label}: the loaded history has iterations below 1")
