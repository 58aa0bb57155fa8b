"""Feature processors and the unsharded FeatureProcessedEmbeddingBagCollection: position
weights by position in bag, the same numbers as an EBC given those weights by hand (forward
and the gradients of the position weights), every interface (per-feature, collection, dict of
JaggedTensors, grouped with carried positions), and construction errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed.grouped_position_weighted import GroupedPositionWeightedModule
from recshard.fx import symbolic_trace
from recshard.modules import feature_processor
from recshard.modules.feature_processor_ import (
    PositionWeightedModule,
    PositionWeightedModuleCollection,
    bag_positions,
)
from recshard.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

# TorchRec's docstring example: 3 features, batch 3
KEYS = ["Feature0", "Feature1", "Feature2"]
VALUES = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7])
LENGTHS = torch.tensor([2, 0, 1, 1, 1, 3, 2, 3, 0])
POSITIONS = torch.tensor([0, 1, 0, 0, 0, 0, 1, 2, 0, 1, 0, 1, 2])


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(KEYS, VALUES, LENGTHS)


def _ramp(n: int) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.float32)  # weight of position p: p + 1


def test_bag_positions() -> None:
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), LENGTHS.cumsum(0)])
    assert torch.equal(bag_positions(offsets, VALUES.numel()), POSITIONS)
    assert bag_positions(torch.zeros(1, dtype=torch.long), 0).numel() == 0


def test_collection_weights_listed_features_and_keeps_layout() -> None:
    pw = PositionWeightedModuleCollection({"Feature1": 3, "Feature2": 4})
    with torch.no_grad():
        pw.position_weights["Feature1"].copy_(_ramp(3))
        pw.position_weights["Feature2"].copy_(_ramp(4))
    out = pw(_kjt())
    expected = (POSITIONS + 1).float()
    expected[:3] = 1.0  # Feature0 has no position weights
    assert torch.equal(out.weights(), expected)
    assert out.keys() == KEYS and torch.equal(out.lengths(), LENGTHS)
    assert torch.equal(out.values(), VALUES)


def test_per_feature_module_and_dict_interface() -> None:
    jt = _kjt()["Feature1"]
    module = PositionWeightedModule(3)
    with torch.no_grad():
        module.position_weight.copy_(_ramp(3))
    assert torch.equal(module(jt).weights(), torch.tensor([1.0, 1.0, 1.0, 2.0, 3.0]))
    old = feature_processor.PositionWeightedModule({"Feature1": 3})
    out = old(_kjt().to_dict())
    assert torch.equal(out["Feature1"].weights(), torch.ones(5))
    assert out["Feature0"].weights_or_none() is None


def test_grouped_module_uses_carried_positions() -> None:
    grouped = GroupedPositionWeightedModule({"Feature1": 3, "Feature2": 3})
    with torch.no_grad():
        grouped.position_weights["Feature2"].copy_(_ramp(3))
    plain = grouped(_kjt())
    carried = KeyedJaggedTensor.from_lengths_sync(KEYS, VALUES, LENGTHS, POSITIONS.float())
    assert torch.equal(grouped(carried).weights(), plain.weights())
    assert list(grouped.state_dict()) == [
        "position_weights.Feature1",
        "position_weights.Feature2",
    ]


def _tables() -> list:
    return [
        EmbeddingBagConfig(num_embeddings=8, embedding_dim=3, name="t0", feature_names=KEYS[:2]),
        EmbeddingBagConfig(num_embeddings=8, embedding_dim=2, name="t1", feature_names=KEYS[2:]),
    ]


def _fp_ebc(form: str) -> FeatureProcessedEmbeddingBagCollection:
    ebc = EmbeddingBagCollection(_tables(), is_weighted=True)
    lengths = {"Feature0": 2, "Feature1": 3, "Feature2": 3}
    if form == "collection":
        processors = PositionWeightedModuleCollection(lengths)
    else:
        processors = {k: PositionWeightedModule(n) for k, n in lengths.items()}
    return FeatureProcessedEmbeddingBagCollection(ebc, processors)


@pytest.mark.parametrize("form", ["collection", "dict"])
def test_fp_ebc_equals_ebc_with_the_weights_by_hand(form: str) -> None:
    torch.manual_seed(0)
    fp = _fp_ebc(form)
    ebc = fp.split()[1]
    params = fp.position_weights()
    with torch.no_grad():
        for p in params.values():
            p.copy_(torch.rand(p.shape) + 0.5)
    out = fp(_kjt())
    # by hand: weights at each position, as a leaf, through the same EBC
    by_hand = torch.cat(
        [
            params[k].detach()[POSITIONS[s]]
            for k, s in zip(KEYS, [slice(0, 3), slice(3, 8), slice(8, 13)])
        ]
    ).requires_grad_()
    ref = ebc(KeyedJaggedTensor.from_lengths_sync(KEYS, VALUES, LENGTHS, by_hand))
    assert torch.allclose(out.values(), ref.values())
    grad = torch.randn_like(ref.values())
    (out.values() * grad).sum().backward()
    (ref.values() * grad).sum().backward()
    for key, s in zip(KEYS, [slice(0, 3), slice(3, 8), slice(8, 13)]):
        expected = torch.zeros_like(params[key]).index_add_(0, POSITIONS[s], by_hand.grad[s])
        assert torch.allclose(params[key].grad, expected)


def test_construction_errors() -> None:
    unweighted = EmbeddingBagCollection(_tables())
    with pytest.raises(ValueError, match="is_weighted=True"):
        FeatureProcessedEmbeddingBagCollection(unweighted, PositionWeightedModuleCollection({}))
    weighted = EmbeddingBagCollection(_tables(), is_weighted=True)
    with pytest.raises(ValueError, match="one processor per feature"):
        FeatureProcessedEmbeddingBagCollection(weighted, {"Feature0": PositionWeightedModule(2)})
    with pytest.raises(ValueError, match="must be > 0"):
        PositionWeightedModuleCollection({"Feature0": 0})


class _Scorer(nn.Module):
    """Dense code around an FP-EBC (or its split halves): what the graph must hold."""

    def __init__(self, fp: FeatureProcessedEmbeddingBagCollection, split: bool) -> None:
        super().__init__()
        self.split = split
        if split:
            self.processors, self.ebc = fp.split()
        else:
            self.fp = fp
        self.over = nn.Linear(8, 1)  # pooled: 3 + 3 + 2

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(self.processors(features)) if self.split else self.fp(features)
        return self.over(pooled.values().relu())


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("form", ["collection", "dict"])
def test_fp_ebc_traces_and_gives_the_eager_numbers(form: str, split: bool) -> None:
    torch.manual_seed(0)
    fp = _fp_ebc(form)
    with torch.no_grad():
        for p in fp.position_weights().values():
            p.copy_(torch.rand(p.shape) + 0.5)
    model = _Scorer(fp, split)
    traced = symbolic_trace(model)
    leaves = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert leaves == (["processors", "ebc", "over"] if split else ["fp", "over"])
    out, expected = traced(_kjt()), model(_kjt())
    assert torch.equal(out, expected)
    grads = []
    for result in (out, expected):
        fp.zero_grad()
        result.sum().backward()
        grads.append({k: p.grad.clone() for k, p in fp.position_weights().items()})
    assert grads[0].keys() == grads[1].keys() == {"Feature0", "Feature1", "Feature2"}
    for key, grad in grads[0].items():
        assert torch.equal(grad, grads[1][key]) and grad.abs().sum() > 0
    too_long = KeyedJaggedTensor.from_lengths_sync(
        KEYS, torch.arange(6), torch.tensor([3, 0, 0, 1, 1, 0, 1, 0, 0])
    )
    with pytest.raises(ValueError, match="max_feature_length 2"):
        traced(too_long)


def test_processors_and_fp_ebc_traced_themselves() -> None:
    torch.manual_seed(0)
    fp = _fp_ebc("dict")
    traced = symbolic_trace(fp)
    torch.testing.assert_close(traced(_kjt()).values(), fp(_kjt()).values(), rtol=0, atol=0)
    collection = PositionWeightedModuleCollection({"Feature1": 3})
    assert torch.equal(symbolic_trace(collection)(_kjt()).weights(), collection(_kjt()).weights())
    old = feature_processor.PositionWeightedModule({"Feature1": 3})
    traced_old = symbolic_trace(old)(_kjt().to_dict())
    assert torch.equal(traced_old["Feature1"].weights(), torch.ones(5))


class _Failing(nn.Module):
    """A custom per-feature processor that refuses every bag."""

    def forward(self, features):
        raise ValueError(f"bags of {features.lengths().tolist()} refused")


class _Refused(ValueError):
    """A processor's own error type."""


class _FailingOwnType(nn.Module):
    def forward(self, features):
        raise _Refused("no")


def _too_long() -> KeyedJaggedTensor:
    """Feature1 has a bag of 4 ids (its max_feature_length is 3 in `_fp_ebc`)."""
    lengths = torch.tensor([2, 0, 1, 4, 1, 0, 2, 3, 0])
    return KeyedJaggedTensor.from_lengths_sync(KEYS, VALUES, lengths)


@pytest.mark.parametrize("form", ["collection", "dict"])
def test_processor_errors_name_the_feature_and_the_value(form: str) -> None:
    fp = _fp_ebc(form)
    with pytest.raises(ValueError, match="feature 'Feature1' has a bag of 4 ids.* 3"):
        fp(_too_long())
    processors, _ = fp.split()  # the dict form: each PositionWeightedModule sees one bag
    with pytest.raises(ValueError, match="feature 'Feature1'.*bag of 4 ids.*max_feature_length 3"):
        processors(_too_long())


def test_other_processor_errors_name_the_feature_and_the_value() -> None:
    ebc = EmbeddingBagCollection(_tables(), is_weighted=True)
    fp = FeatureProcessedEmbeddingBagCollection(
        ebc,
        {"Feature0": PositionWeightedModule(2), "Feature1": _Failing(), "Feature2": _Failing()},
    )
    with pytest.raises(ValueError, match=r"feature 'Feature1': bags of \[1, 1, 3\] refused"):
        fp(_kjt())
    with pytest.raises(ValueError, match=r"feature 'Feature1': bags of \[1, 1, 3\] refused"):
        fp.split()[0](_kjt())
    own = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(_tables(), is_weighted=True),
        {"Feature0": _FailingOwnType(), "Feature1": _Failing(), "Feature2": _Failing()},
    )
    with pytest.raises(_Refused) as raised:  # its own type kept, the feature in a note
        own.split()[0](_kjt())
    assert raised.value.__notes__ == ["raised by the processor of feature 'Feature0'"]
    old = feature_processor.PositionWeightedModule({"Feature2": 2})
    with pytest.raises(ValueError, match="feature 'Feature2' has a bag of 3 ids.* 2"):
        old(_kjt().to_dict())
    grouped = GroupedPositionWeightedModule({"Feature1": 3, "Feature2": 3})
    with pytest.raises(ValueError, match="feature 'Feature1' has a bag of 4 ids.* 3"):
        grouped(_too_long())
    carried = KeyedJaggedTensor.from_lengths_sync(KEYS, VALUES, LENGTHS, POSITIONS.float() * 2)
    with pytest.raises(ValueError, match=r"feature 'Feature1': positions 0\.\.4 .* its 3"):
        grouped(carried)
    with pytest.raises(ValueError, match="max_feature_length is 0"):
        PositionWeightedModule(0)
    with pytest.raises(ValueError, match="'Feature0' is -1"):
        PositionWeightedModuleCollection({"Feature0": -1})
    with pytest.raises(ValueError, match="'Feature0' is 0"):
        GroupedPositionWeightedModule({"Feature0": 0})
