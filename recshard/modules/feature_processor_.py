"""Feature processors: modules that give each id of a feature a weight before pooling.

`PositionWeightedModule` (one feature, `JaggedTensor -> JaggedTensor`) and
`PositionWeightedModuleCollection` (many features, `KeyedJaggedTensor -> KeyedJaggedTensor`)
weight the id at position p of a bag by a learned `position_weight[p]` (initialised to 1);
the weights replace the input's weights. Position weights are ordinary dense parameters.

The position of an id inside its bag is what the weight is looked up by; the functions here
(`bag_positions`, `gather_position_weights`) are the one home of that rule, shared with the
sharded module, which computes positions before its input dist and carries them as weights
(row-wise sharding splits bags across ranks, so positions cannot be recomputed there).
"""

from __future__ import annotations

import abc
from typing import Dict, List, Mapping

import torch
from torch import nn

from recshard.sparse import JaggedTensor, KeyedJaggedTensor


def bag_positions(offsets: torch.Tensor, num_values: int) -> torch.Tensor:
    """Each value's position inside its bag: `[num_values]` int64 (0, 1, ... per bag)."""
    offsets = offsets.reshape(-1).long()
    lengths = offsets[1:] - offsets[:-1]
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=num_values)
    return torch.arange(num_values, device=offsets.device) - starts


def with_weights(features: KeyedJaggedTensor, weights: torch.Tensor | None) -> KeyedJaggedTensor:
    """The same ids, lengths and batch layout as `features`, with `weights` ([num_values])."""
    variable = features.variable_stride_per_key()
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        weights,
        lengths=features.lengths(),
        offsets=features.offsets(),
        stride=features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
        length_per_key=features.length_per_key(),
        offset_per_key=features.offset_per_key(),
        inverse_indices=features.inverse_indices_or_none(),
        validate=False,
    )


def gather_position_weights(
    features: KeyedJaggedTensor,
    positions: torch.Tensor,
    position_weights: Mapping[str, torch.Tensor],
    feature_of: Mapping[str, str] | None = None,
) -> torch.Tensor:
    """Per value, `position_weights[feature][position]`, 1.0 for features without position
    weights: `[num_values]` float. `feature_of` maps a key of `features` to the feature whose
    weights it uses (a feature several tables read is keyed `feature@table` once routed)."""
    pieces: List[torch.Tensor] = []
    for key, seq in zip(features.keys(), torch.split(positions, features.length_per_key())):
        param = position_weights.get(feature_of[key] if feature_of else key)
        if param is None:
            pieces.append(torch.ones(seq.numel(), device=seq.device))
            continue
        try:
            pieces.append(torch.gather(param, 0, seq))
        except RuntimeError as e:  # positions carried in from outside (weights of a KJT)
            raise ValueError(
                f"feature '{key}': positions {int(seq.min())}..{int(seq.max())} fall outside "
                f"its {param.numel()} position weights (max_feature_length)"
            ) from e
    if not pieces:
        return torch.empty(0, device=features.values().device)
    return torch.cat(pieces)


def position_length_error(
    features: KeyedJaggedTensor, max_lengths: Mapping[str, int], owner: str
) -> str | None:
    """Why `features` cannot be position weighted (a bag longer than its feature's
    `max_feature_length`: its weight would not exist), or None. Keys absent from `features`
    are left to the embedding module's own checks."""
    lengths_by_key = features.to_dict()
    for feature, limit in max_lengths.items():
        jt = lengths_by_key.get(feature)
        if jt is None or jt.lengths().numel() == 0:
            continue
        longest = int(jt.lengths().max())
        if longest > limit:
            return (
                f"{owner}: feature '{feature}' has a bag of {longest} ids, longer than its "
                f"max_feature_length {limit} (positions past it have no weight)"
            )
    return None


def position_weight_dict(
    max_feature_lengths: Mapping[str, int], device: torch.device | None
) -> nn.ParameterDict:
    """Per feature, one weight per position of its bags (`[max_feature_length]`), all 1.0."""
    weights = nn.ParameterDict(
        {
            key: nn.Parameter(torch.empty([length], device=device))
            for key, length in max_feature_lengths.items()
        }
    )
    ones_(weights)
    return weights


def ones_(weights: nn.ParameterDict) -> None:
    """Every position weight back to 1.0 (also after materializing from `meta`)."""
    with torch.no_grad():
        for param in weights.values():
            param.fill_(1.0)


def _check_lengths(max_feature_lengths: Mapping[str, int], owner: str) -> None:
    for feature, length in max_feature_lengths.items():
        if length <= 0:
            raise ValueError(f"{owner}: max_feature_length of '{feature}' is {length}, must be > 0")


class FeatureProcessor(nn.Module):
    """One feature's processor: `JaggedTensor -> JaggedTensor` with weights set."""

    @abc.abstractmethod
    def forward(self, features: JaggedTensor) -> JaggedTensor: ...


class PositionWeightedModule(FeatureProcessor):
    """Weights the id at position p of each bag by `position_weight[p]` ([max_feature_length],
    starts at 1.0)."""

    def __init__(self, max_feature_length: int, device: torch.device | None = None) -> None:
        super().__init__()
        if max_feature_length <= 0:
            raise ValueError(
                f"PositionWeightedModule: max_feature_length is {max_feature_length}, must be > 0"
            )
        self.max_feature_length = max_feature_length
        self.position_weight = nn.Parameter(torch.empty([max_feature_length], device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.position_weight.fill_(1.0)

    def forward(self, features: JaggedTensor) -> JaggedTensor:
        """The same ids with weights `position_weight[position in bag]`."""
        values = features.values()
        positions = bag_positions(features.offsets(), values.numel())
        if positions.numel() and int(positions.max()) >= self.max_feature_length:
            raise ValueError(
                f"PositionWeightedModule: a bag of {int(positions.max()) + 1} ids is longer "
                f"than max_feature_length {self.max_feature_length}"
            )
        return JaggedTensor(
            values,
            torch.gather(self.position_weight, 0, positions),
            lengths=features.lengths(),
            offsets=features.offsets(),
        )


class FeatureProcessorsCollection(nn.Module):
    """Processors of many features at once: `KeyedJaggedTensor -> KeyedJaggedTensor`."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor: ...


class PositionWeightedModuleCollection(FeatureProcessorsCollection):
    """Position weights for the features in `max_feature_lengths` (`position_weights.<f>`,
    [max_feature_length], starts at 1.0); other features get weight 1.0."""

    def __init__(
        self, max_feature_lengths: Dict[str, int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        _check_lengths(max_feature_lengths, type(self).__name__)
        self.max_feature_lengths = dict(max_feature_lengths)
        self.position_weights = position_weight_dict(max_feature_lengths, device)

    def reset_parameters(self) -> None:
        ones_(self.position_weights)

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The same ids and layout, weights replaced by the position weights."""
        error = position_length_error(features, self.max_feature_lengths, type(self).__name__)
        if error is not None:
            raise ValueError(error)
        positions = bag_positions(features.offsets(), features.values().numel())
        weights = gather_position_weights(features, positions, dict(self.position_weights))
        return with_weights(features, weights)

    def copy(self, device: torch.device) -> nn.Module:
        """Move to `device` in place (TorchRec's CopyMixIn)."""
        return self.to(device)
