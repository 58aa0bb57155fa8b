"""The interface of managed collision modules and the bucket layout they share.

A managed collision module maps raw ids to rows `[0, output_size())` of one table. Ids and rows
are cut into `buckets`: bucket `id % buckets` owns a contiguous range of rows
(`bucket_row_starts`), the unit a row-wise sharded table is cut at.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List

import torch
from torch import nn

from recshard.sparse import JaggedTensor

FREE = torch.iinfo(torch.int64).max  # raw id of a row no id holds
HashFunc = Callable[[torch.Tensor, int], torch.Tensor]


def bucket_row_starts(zch_size: int, buckets: int) -> List[int]:
    """First row of each bucket and the end: `buckets + 1` ints, sizes differ by at most one."""
    base, extra = divmod(zch_size, buckets)
    return [b * base + min(b, extra) for b in range(buckets + 1)]


class ManagedCollisionModule(nn.Module):
    """Maps the ids of some features to rows `[0, output_size())` of one table."""

    def __init__(self, device: torch.device | str | None) -> None:
        super().__init__()
        self._device = torch.device(device if device is not None else "cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    @abc.abstractmethod
    def preprocess(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """Ids hashed into `[0, input_size())` (no-op without a hash function)."""

    @abc.abstractmethod
    def profile(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """Count the ids (training only); evict when the interval is reached."""

    @abc.abstractmethod
    def remap(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """Ids replaced by their rows."""

    @abc.abstractmethod
    def evict(self) -> torch.Tensor | None:
        """Rows given to new ids since the last call (to reset), or None."""

    @abc.abstractmethod
    def output_size(self) -> int:
        """Rows of the table (global)."""

    @abc.abstractmethod
    def input_size(self) -> int:
        """Ids are in `[0, input_size())` after preprocessing."""

    @abc.abstractmethod
    def buckets(self) -> int:
        """Buckets the ids and rows are cut into (the unit of row-wise sharding)."""

    @abc.abstractmethod
    def open_slots(self) -> torch.Tensor:
        """Rows no id holds (reserved rows excluded), `[1]`."""

    @abc.abstractmethod
    def validate_state(self) -> None:
        """Check the state (after loading a checkpoint) and rebuild what derives from it."""

    @abc.abstractmethod
    def rebuild_with_bucket_range(
        self, first: int, last: int, device: torch.device | None = None
    ) -> ManagedCollisionModule:
        """A module holding buckets `[first, last)` only, with this module's state for them."""


def with_values(jt: JaggedTensor, values: torch.Tensor) -> JaggedTensor:
    return JaggedTensor(values=values, lengths=jt.lengths(), weights=jt.weights_or_none())
