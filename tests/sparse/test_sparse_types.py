"""Documented examples, KeyedTensor, fx leaves and every bad-input message of the sparse types."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def example_kjt(weighted: bool = False) -> KeyedJaggedTensor:
    # f1: [[0, 1], [], [2]]; f2: [[3], [4], [5, 6, 7]]
    return KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f2"],
        torch.arange(8),
        torch.tensor([2, 0, 1, 1, 1, 3]),
        weights=torch.arange(8, dtype=torch.float) if weighted else None,
    )


def test_documented_layout() -> None:
    kjt = example_kjt()
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [3, 5]
    assert kjt.offset_per_key() == [0, 3, 8]
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 5, 8]
    assert kjt["f2"].to_dense()[2].tolist() == [5, 6, 7]
    vbe = KeyedJaggedTensor(
        ["a", "b"],
        torch.arange(5),
        lengths=torch.tensor([1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [3]],
    )
    assert vbe.stride_per_key() == [2, 3] and vbe.stride() == 3
    assert vbe.length_per_key() == [2, 3]


def test_lazy_lengths_offsets_cached() -> None:
    kjt = KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([0, 1, 3]))
    assert kjt.lengths_or_none() is None
    assert kjt.lengths().tolist() == [1, 2]
    assert kjt.lengths() is kjt.lengths()
    assert kjt.offsets_or_none() is not None


def test_empty_and_concat_weighted() -> None:
    empty = KeyedJaggedTensor.empty(is_weighted=True)
    assert empty.keys() == [] and empty.values().numel() == 0 and empty.weights().numel() == 0
    both = KeyedJaggedTensor.concat([example_kjt(True), example_kjt(True).permute([1, 0])])
    assert both.keys() == ["f1", "f2", "f2", "f1"]
    assert both.weights().tolist()[:8] == list(range(8))


def test_keyed_tensor_ops_and_regroup_grad() -> None:
    a = KeyedTensor.from_tensor_list(["a", "b"], [torch.ones(2, 1), 2 * torch.ones(2, 2)])
    c_values = torch.full((2, 3), 3.0, requires_grad=True)
    c = KeyedTensor(["c"], [3], c_values)
    assert a.offset_per_key() == [0, 1, 3] and a["b"].shape == (2, 2)
    assert set(a.to_dict()) == {"a", "b"}
    g1, g2 = KeyedTensor.regroup([a, c], [["a", "c"], ["b"]])
    assert g1.shape == (2, 4) and g2.shape == (2, 2)
    assert g1[0].tolist() == [1, 3, 3, 3]
    (g1 * torch.arange(4.0)).sum().backward()
    assert c_values.grad[0].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(KeyError, match="no key 'zz'"):
        a["zz"]
    with pytest.raises(ValueError, match="key 'a' appears in more than one"):
        KeyedTensor.regroup([a, a], [["a"]])
    with pytest.raises(ValueError, match=r"do not have 4 \(= sum of length_per_key"):
        KeyedTensor(["x", "y"], [1, 3], torch.zeros(2, 3))


class _Leaf(nn.Module):
    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return kjt.values().float().sum()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf = _Leaf()

    def forward(self, batch: dict) -> torch.Tensor:
        return self.leaf(batch["sparse"]) + 1


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _Leaf) or super().is_leaf_module(m, qualname)


def test_fx_traces_kjt_as_leaf_input() -> None:
    model = _Model()
    graph = torch.fx.GraphModule(model, _LeafTracer().trace(model))
    targets = [n.target for n in graph.graph.nodes if n.op == "call_module"]
    assert targets == ["leaf"]
    assert graph({"sparse": example_kjt()}).item() == 29.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 1, 0, 2])),
            r"lengths sum to 4 \(per key: a=2, b=2\) but values has 3 entries",
        ),
        (
            dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2, -1, 1])),
            "key 'b' has negative length -1 at batch position 0",
        ),
        (
            dict(
                keys=["a"],
                values=torch.arange(3),
                lengths=torch.tensor([1, 2]),
                weights=torch.ones(2),
            ),
            "weights has 2 entries but values has 3",
        ),
        (
            dict(keys=["a", "a"], values=torch.arange(2), lengths=torch.tensor([1, 1])),
            "duplicate key 'a'",
        ),
        (
            dict(keys=["a"], values=torch.arange(3), offsets=torch.tensor([1, 2, 3])),
            "offsets must start at 0, got 1",
        ),
        (
            dict(keys=["a", "b"], values=torch.arange(3), offsets=torch.tensor([0, 2, 1, 3, 3])),
            r"offsets decrease at entry 2 \(key 'a'\): 2 -> 1",
        ),
        (
            dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1])),
            r"lengths has 3 entries, expected 2",
        ),
        (
            dict(
                keys=["a", "b"],
                values=torch.arange(5),
                lengths=torch.tensor([1, 2, 0, 2]),
                offsets=torch.tensor([0, 1, 3, 5, 5]),
            ),  # same total, rows of b disagree
            "offsets are not the running sum of lengths: key 'b' at batch position 0 has length 0 "
            "but offsets step 2",
        ),
    ],
)
def test_bad_input_messages(kwargs: dict, message: str) -> None:
    # structural faults raise at construction, the others from validate()
    with pytest.raises(ValueError, match=message):
        KeyedJaggedTensor(**kwargs).validate()
    if "lengths" in kwargs and "offsets" not in kwargs:
        with pytest.raises(ValueError, match=message):
            KeyedJaggedTensor.from_lengths_sync(**kwargs).validate()


def test_validation_can_be_skipped_on_hot_paths() -> None:
    kjt = KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([5]), validate=False)
    assert kjt.keys() == ["a"]


def test_split_and_permute_errors() -> None:
    kjt = example_kjt()
    with pytest.raises(ValueError, match=r"segments \[1\] sum to 1, but there are 2 keys"):
        kjt.split([1])
    with pytest.raises(ValueError, match=r"indices \[2\] out of range for 2 keys"):
        kjt.permute([0, 2])
    with pytest.raises(ValueError, match="batch sizes differ"):
        KeyedJaggedTensor.concat(
            [
                example_kjt(),
                KeyedJaggedTensor.from_lengths_sync(["z"], torch.arange(1), torch.tensor([1])),
            ]
        )
    with pytest.raises(ValueError, match=r"keys \['b'\] have no weights but others do"):
        KeyedJaggedTensor.from_jt_dict(
            {
                "a": JaggedTensor(torch.arange(2), torch.ones(2), lengths=torch.tensor([1, 1])),
                "b": JaggedTensor(torch.arange(1), lengths=torch.tensor([1])),
            }
        )
