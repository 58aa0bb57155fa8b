"""GroupedPositionWeightedModule: position weights over a whole `KeyedJaggedTensor`, on either
side of an input dist.

Before the dist the KJT has no weights and positions come from its offsets; after a row-wise
dist (bags split across ranks) the KJT carries each id's position as its weight, and those are
used. Features without position weights get weight 1.0. State: `position_weights.<feature>`.
"""

from __future__ import annotations

from typing import Dict

import torch

from recshard.modules.feature_processor import BaseGroupedFeatureProcessor
from recshard.modules.feature_processor_ import (
    bag_positions,
    gather_position_weights,
    ones_,
    position_length_error,
    position_weight_dict,
    with_weights,
)
from recshard.sparse import KeyedJaggedTensor


class GroupedPositionWeightedModule(BaseGroupedFeatureProcessor):
    """`max_feature_lengths`: feature -> number of positions weighted (each > 0)."""

    def __init__(
        self, max_feature_lengths: Dict[str, int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        for feature, length in max_feature_lengths.items():
            if length <= 0:
                raise ValueError(
                    f"GroupedPositionWeightedModule: max_feature_length of '{feature}' is "
                    f"{length}, must be > 0"
                )
        self.max_feature_lengths = dict(max_feature_lengths)
        self.position_weights = position_weight_dict(max_feature_lengths, device)

    def reset_parameters(self) -> None:
        """Every position weight 1.0 (also after materializing from `meta`)."""
        ones_(self.position_weights)

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The same ids and layout, weights set to the position weights."""
        carried = features.weights_or_none()
        if carried is None:
            error = position_length_error(features, self.max_feature_lengths, type(self).__name__)
            if error is not None:
                raise ValueError(error)
            positions = bag_positions(features.offsets(), features.values().numel())
        else:
            positions = carried.long()
        weights = gather_position_weights(features, positions, dict(self.position_weights))
        return with_weights(features, weights)
