"""TorchRec's first feature-processor interface: processors over a dict of `JaggedTensor`s.

`PositionWeightedModule(max_feature_lengths)` here takes `{feature: JaggedTensor}` and returns
it with the listed features position weighted (`position_weights.<f>`, starts at 1.0). The
newer per-feature interface (`FeatureProcessedEmbeddingBagCollection` takes it) lives in
`recshard.modules.feature_processor_`; both weight by the same rule.
"""

from __future__ import annotations

import abc
from typing import Dict

import torch
from torch import nn

from recshard.modules.feature_processor_ import bag_positions, ones_, position_weight_dict
from recshard.sparse import JaggedTensor, KeyedJaggedTensor


class BaseFeatureProcessor(nn.Module):
    """Processors over `{feature: JaggedTensor}`."""

    @abc.abstractmethod
    def forward(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]: ...


class BaseGroupedFeatureProcessor(nn.Module):
    """Processors over a whole `KeyedJaggedTensor`."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor: ...


class PositionWeightedModule(BaseFeatureProcessor):
    """Adds position weights to the features of `max_feature_lengths` (`position_weights.<f>`,
    one weight per position up to the feature's max length)."""

    def __init__(
        self, max_feature_lengths: Dict[str, int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.max_feature_lengths = dict(max_feature_lengths)
        self.position_weights = position_weight_dict(max_feature_lengths, device)

    def reset_parameters(self) -> None:
        ones_(self.position_weights)

    def forward(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """`features` (updated in place, as TorchRec) with weights on the listed features."""
        for key, weight in self.position_weights.items():
            jt = features[key]
            positions = bag_positions(jt.offsets(), jt.values().numel())
            if positions.numel() and int(positions.max()) >= weight.numel():
                raise ValueError(
                    f"PositionWeightedModule: feature '{key}' has a bag of "
                    f"{int(positions.max()) + 1} ids, longer than its max length {weight.numel()}"
                )
            features[key] = JaggedTensor(
                jt.values(),
                torch.gather(weight, 0, positions),
                lengths=jt.lengths(),
                offsets=jt.offsets(),
            )
        return features
