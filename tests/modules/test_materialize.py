"""`materialize`: modules built on `meta` get real tensors holding their initial values, also
when the tensors sit in a child (a ParameterDict) that the owner's `reset_parameters` fills."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recshard.distributed.grouped_position_weighted import GroupedPositionWeightedModule
from recshard.modules.feature_processor import PositionWeightedModule as DictPositionWeighted
from recshard.modules.feature_processor_ import PositionWeightedModuleCollection
from recshard.modules.materialize import materialize

LENGTHS = {"a": 3, "b": 5}


@pytest.mark.parametrize(
    "make", [PositionWeightedModuleCollection, GroupedPositionWeightedModule, DictPositionWeighted]
)
def test_position_weights_built_on_meta_start_at_one(make: type) -> None:
    module = make(LENGTHS, device=torch.device("meta"))
    # poison the memory to_empty will hand out, so an uninitialized read cannot pass by luck
    for _ in range(20):
        torch.full([5], 1e30).add_(0)
    materialize(module, torch.device("cpu"))
    weights = {k: p.tolist() for k, p in module.position_weights.items()}
    assert weights == {"a": [1.0] * 3, "b": [1.0] * 5}


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ParameterDict({"w": nn.Parameter(torch.empty(2, device="meta"))})


def test_a_meta_tensor_nothing_initializes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'inner\.w' is on meta .* reset_parameters"):
        materialize(_NoInit(), torch.device("cpu"))


def test_skipped_modules_keep_their_tensors() -> None:
    outer = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2, device="meta"))
    materialize(outer, torch.device("cpu"), skip=lambda m: m is outer[1])
    assert not outer[0].weight.is_meta and outer[1].weight.is_meta
