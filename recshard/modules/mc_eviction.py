"""Eviction policies of managed collision (ZCH) tables and the threshold filters they may take.

A policy says which per-row metadata a table keeps (`counts`: how often the row's id was seen,
`last_access_iter`: the last training iteration it was seen) and scores rows from it: at an
eviction, the ids already in a bucket and the new ids seen since the last eviction compete on
score and the highest keep (or get) a row. Ties keep the id that already holds a row.

Scores, as TorchRec's policies:
- `LFU_EvictionPolicy`: `counts`.
- `LRU_EvictionPolicy`: `-(iter - last_access_iter + 1) ** decay_exponent`.
- `DistanceLFU_EvictionPolicy`: `counts / (iter - last_access_iter + 1) ** decay_exponent`.

A threshold filter `f(counts [U]) -> (mask [U], threshold)` drops the unique ids seen since the
last eviction whose counts it rejects, before they update or compete (experimental in TorchRec).
"""

from __future__ import annotations

import abc
import math
from typing import Callable, Dict, List, NamedTuple, Tuple

import torch

ThresholdFilter = Callable[[torch.Tensor], Tuple[torch.Tensor, float | torch.Tensor]]

COUNTS = "counts"
LAST_ACCESS = "last_access_iter"


class MCHEvictionPolicyMetadataInfo(NamedTuple):
    """One per-row metadata buffer a policy keeps (`_mch_<metadata_name>`)."""

    metadata_name: str
    is_mch_metadata: bool
    is_history_metadata: bool


class MCHEvictionPolicy(abc.ABC):
    """Base of the policies: the metadata they keep and the score of a row."""

    def __init__(
        self,
        metadata_info: List[MCHEvictionPolicyMetadataInfo],
        threshold_filtering_func: ThresholdFilter | None = None,
    ) -> None:
        self._metadata_info = metadata_info
        self._threshold_filtering_func = threshold_filtering_func

    @property
    def metadata_info(self) -> List[MCHEvictionPolicyMetadataInfo]:
        return self._metadata_info

    @property
    def metadata_names(self) -> List[str]:
        return [m.metadata_name for m in self._metadata_info]

    @property
    def threshold_filtering_func(self) -> ThresholdFilter | None:
        return self._threshold_filtering_func

    @abc.abstractmethod
    def eviction_scores(self, current_iter: int, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Score of each row `[N]` from its metadata (each `[N]`); lower scores go first."""


def _decay(decay_exponent: float, policy: str) -> float:
    """`decay_exponent`, refused when NaN (every score would be NaN: no order to evict by)."""
    if math.isnan(decay_exponent):
        raise ValueError(f"{policy}: decay_exponent must be a number, got {decay_exponent}")
    return decay_exponent


def _distance(current_iter: int, last_access: torch.Tensor, decay_exponent: float) -> torch.Tensor:
    return torch.pow((current_iter - last_access + 1).double(), decay_exponent)


class LFU_EvictionPolicy(MCHEvictionPolicy):
    """Least frequently used goes first; counts accumulate for as long as an id holds its row."""

    def __init__(self, threshold_filtering_func: ThresholdFilter | None = None) -> None:
        super().__init__(
            [MCHEvictionPolicyMetadataInfo(COUNTS, True, False)], threshold_filtering_func
        )

    def eviction_scores(self, current_iter: int, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        return metadata[COUNTS].double()


class LRU_EvictionPolicy(MCHEvictionPolicy):
    """Least recently used goes first."""

    def __init__(
        self, decay_exponent: float = 1.0, threshold_filtering_func: ThresholdFilter | None = None
    ) -> None:
        super().__init__(
            [MCHEvictionPolicyMetadataInfo(LAST_ACCESS, True, True)], threshold_filtering_func
        )
        self._decay_exponent = _decay(decay_exponent, "LRU_EvictionPolicy")

    def eviction_scores(self, current_iter: int, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        return -_distance(current_iter, metadata[LAST_ACCESS], self._decay_exponent)


class DistanceLFU_EvictionPolicy(MCHEvictionPolicy):
    """Counts discounted by the time since the last access."""

    def __init__(
        self, decay_exponent: float = 1.0, threshold_filtering_func: ThresholdFilter | None = None
    ) -> None:
        super().__init__(
            [
                MCHEvictionPolicyMetadataInfo(COUNTS, True, False),
                MCHEvictionPolicyMetadataInfo(LAST_ACCESS, True, True),
            ],
            threshold_filtering_func,
        )
        self._decay_exponent = _decay(decay_exponent, "DistanceLFU_EvictionPolicy")

    def eviction_scores(self, current_iter: int, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        distance = _distance(current_iter, metadata[LAST_ACCESS], self._decay_exponent)
        return metadata[COUNTS].double() / distance


@torch.no_grad()
def dynamic_threshold_filter(
    id_counts: torch.Tensor, threshold_skew_multiplier: float = 10.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep ids seen more than `threshold_skew_multiplier` times the mean count."""
    threshold = id_counts.sum() * (threshold_skew_multiplier / id_counts.numel())
    return id_counts > threshold, threshold


@torch.no_grad()
def average_threshold_filter(id_counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep ids seen more often than the mean count."""
    threshold = id_counts.double().mean()
    return id_counts > threshold, threshold


@torch.no_grad()
def probabilistic_threshold_filter(
    id_counts: torch.Tensor, per_id_probability: float = 0.01
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep an id seen `c` times with probability `1 - (1 - per_id_probability) ** c` (draws
    from torch's global generator: sharded and unsharded runs differ unless seeded alike)."""
    scores = 1 - torch.pow(
        torch.full_like(id_counts, 1 - per_id_probability, dtype=torch.double), id_counts
    )
    threshold = torch.rand(id_counts.size(), device=id_counts.device, dtype=torch.double)
    return scores > threshold, threshold
