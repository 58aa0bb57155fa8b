"""The MCH module's state that every rank reads whole on load (`entry_state_names`): the
history of ids seen since the last eviction (entries, not rows: each rank keeps its buckets'
entries, so a checkpoint of one world size loads at another), and for a replica (a
column-split table's module, held whole on each rank of its column shards) the row-indexed
buffers too. A mixin of `MCHManagedCollisionModule`, which supplies the attributes read here."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

from recshard.modules.mc_history import IDS, check_history


class MCHEntryState(nn.Module):
    """Entry state of `MCHManagedCollisionModule` (see the module docstring)."""

    def history_names(self) -> List[str]:
        return self._history.names()

    def entry_state_names(self) -> List[str]:
        """Buffers every rank reads whole on load, keeping its part: the history (entries,
        not rows); for a replica (`replicated`: a column-split table's module, held whole on
        each rank of its column shards) also the row-indexed ones."""
        rows = ["_mch_raw_ids", *(f"_mch_{m}" for m in self.metadata())] if self.replicated else []
        return rows + self._history.names()

    def check_entry_state(self, values: Dict[str, torch.Tensor]) -> None:
        """ValueError unless `values` is state this module can load (any history length)."""
        names = self._history.names()
        mine = {n: v for n, v in values.items() if n in names}
        check_history(mine, names, self._input_hash_size, self._label)
        for name in set(self.entry_state_names()) - set(names):
            got = tuple(values[name].shape) if name in values else "nothing"
            if got != (self._zch_size,):
                raise ValueError(
                    f"{self._label}: a replica (column-split table) loads the table's whole "
                    f"'{name}' [{self._zch_size}], got {got} (load a checkpoint or a full one)"
                )

    @torch.no_grad()
    def load_entry_state(self, values: Dict[str, torch.Tensor]) -> None:
        """Load what `entry_state_names` names: a replica's whole rows, and the history's
        entries of this module's buckets (e.g. from a whole table's, saved at another world
        size)."""
        self.check_entry_state(values)
        history = self._history.names()
        rows = [n for n in self.entry_state_names() if n not in history]
        for name in rows:
            getattr(self, name).copy_(values[name])
        if rows:
            self.validate_state()
        self._load_history({n: values[n] for n in history})

    def _load_history(self, values: Dict[str, torch.Tensor]) -> None:
        ids = values[IDS].to(self.device)
        first, last = self._bucket_range
        bucket = ids % self._buckets
        mine = (bucket >= first) & (bucket < last)
        self._history.reset({n: v.to(self.device)[mine] for n, v in values.items()})
        self._sync_history()

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        """The history is loaded at the length it was saved with (its buffers resized first)."""
        for name in self._history.names():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, torch.empty_like(value, device=self.device))
        super()._load_from_state_dict(state_dict, prefix, *args)
