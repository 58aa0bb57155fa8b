"""Sparse types built inside a traced forward, `device()` as a method, meta KJTs (TorchRec's
behaviour: its sparse types are fx-constructible and `device()` is a method on all three)."""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from recshard.fx import symbolic_trace
from recshard.modules import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

META = torch.device("meta")


class _BuildsSparseTypes(nn.Module):
    """Builds a KJT from raw tensors, pools it, regroups the result as a new KeyedTensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"]
                ),
                EmbeddingBagConfig(
                    name="t2", embedding_dim=2, num_embeddings=10, feature_names=["f2"]
                ),
            ]
        )

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> KeyedTensor:
        features = KeyedJaggedTensor(keys=["f1", "f2"], values=ids, lengths=lengths)
        pooled = self.ebc(features)
        doubled = JaggedTensor(values=ids * 2, lengths=lengths)
        extra = doubled.values().float().sum().view(1, 1).expand(pooled.values().size(0), 1)
        return KeyedTensor(
            keys=["pooled", "extra"],
            length_per_key=[5, 1],
            values=torch.cat([pooled.values(), extra], dim=1),
        )


def _call_functions(traced: torch.fx.GraphModule) -> List[object]:
    return [n.target for n in traced.graph.nodes if n.op == "call_function"]


def test_sparse_types_built_in_forward_become_graph_nodes() -> None:
    torch.manual_seed(0)
    model = _BuildsSparseTypes()
    traced = symbolic_trace(model)
    built = _call_functions(traced)
    assert KeyedJaggedTensor in built and JaggedTensor in built and KeyedTensor in built
    ids, lengths = torch.tensor([1, 2, 3, 9, 4]), torch.tensor([2, 1, 0, 2])
    out, expected = traced(ids, lengths), model(ids, lengths)
    assert isinstance(out, KeyedTensor) and out.keys() == ["pooled", "extra"]
    torch.testing.assert_close(out.values(), expected.values())
    # outside a trace the constructors build real objects
    assert (
        type(KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.tensor([5])))
        is KeyedJaggedTensor
    )


def test_device_is_a_method_on_every_sparse_type() -> None:
    ids, lengths = torch.tensor([1, 2, 3]), torch.tensor([1, 2])
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=ids, lengths=lengths)
    jt = JaggedTensor(values=ids, lengths=lengths)
    kt = KeyedTensor(keys=["a"], length_per_key=[2], values=torch.zeros(3, 2))
    assert kjt.device() == jt.device() == kt.device() == torch.device("cpu")
    assert kjt.to(META).device() == META


def test_kjt_built_on_meta_infers_stride_and_prints_without_data() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.empty(7, dtype=torch.int64, device=META),
        lengths=torch.empty(6, dtype=torch.int32, device=META),
    )
    assert kjt.device() == META and kjt.stride() == 3 and kjt.keys() == ["a", "b"]
    assert repr(kjt) == "KeyedJaggedTensor(keys=['a', 'b'], stride=3, device='meta')"
    assert str(kjt) == repr(kjt) + "\n"


def test_from_dense_lengths_traces_with_and_without_weights() -> None:
    traced = torch.fx.symbolic_trace(JaggedTensor.from_dense_lengths)
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    lengths = torch.tensor([2, 1])
    plain = traced(values=values, lengths=lengths)
    assert plain.values().tolist() == [1.0, 2.0, 4.0] and plain.weights_or_none() is None
    weighted = traced(values=values, lengths=lengths, weights=values * 10)
    assert weighted.weights().tolist() == [10.0, 20.0, 40.0]


class _Concat(nn.Module):
    def forward(self, kjts: List[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.concat(kjts)


class _Regroup(nn.Module):
    def forward(self, kts: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
        return KeyedTensor.regroup(kts, groups)


class _RegroupAsDict(nn.Module):
    def forward(self, kts: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        return KeyedTensor.regroup_as_dict(kts, [["y", "z"], ["x"]], ["first", "second"])


def test_list_taking_sparse_ops_are_graph_leaves() -> None:
    """concat / regroup take a list that is one placeholder when traced: they must be leaf
    calls (TorchRec's fx.wrap), run on the real list when the graph runs."""
    a = KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]))
    b = KeyedJaggedTensor(["b", "c"], torch.tensor([4, 5]), lengths=torch.tensor([0, 1, 1, 0]))
    concat = symbolic_trace(_Concat())([a, b])
    assert concat.keys() == ["a", "b", "c"] and concat.lengths().tolist() == [1, 2, 0, 1, 1, 0]
    assert concat["c"].values().tolist() == [5]

    kts = [
        KeyedTensor(["x", "y"], [1, 2], torch.arange(6.0).view(2, 3)),
        KeyedTensor(["z"], [1], torch.tensor([[10.0], [20.0]])),
    ]
    regroup = symbolic_trace(_Regroup())
    out = regroup(kts, [["z", "x"], ["y"]])
    assert out[0].tolist() == [[10.0, 0.0], [20.0, 3.0]] and out[1].tolist() == [
        [1.0, 2.0],
        [4.0, 5.0],
    ]
    as_dict = symbolic_trace(_RegroupAsDict())(kts)
    assert list(as_dict) == ["first", "second"]
    assert as_dict["first"].tolist() == [[1.0, 2.0, 10.0], [4.0, 5.0, 20.0]]
    assert as_dict["second"].tolist() == [[0.0], [3.0]]
