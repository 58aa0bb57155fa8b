"""Sparse types built inside a traced forward, `device()` as a method, meta KJTs (TorchRec's
behaviour: its sparse types are fx-constructible and `device()` is a method on all three)."""

from __future__ import annotations

from typing import List

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
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"]),
            EmbeddingBagConfig(name="t2", embedding_dim=2, num_embeddings=10, feature_names=["f2"]),
        ])

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> KeyedTensor:
        features = KeyedJaggedTensor(keys=["f1", "f2"], values=ids, lengths=lengths)
        pooled = self.ebc(features)
        doubled = JaggedTensor(values=ids * 2, lengths=lengths)
        extra = doubled.values().float().sum().view(1, 1).expand(pooled.values().size(0), 1)
        return KeyedTensor(keys=["pooled", "extra"], length_per_key=[5, 1],
                           values=torch.cat([pooled.values(), extra], dim=1))


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
    assert type(KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.tensor([5]))) is KeyedJaggedTensor


def test_device_is_a_method_on_every_sparse_type() -> None:
    ids, lengths = torch.tensor([1, 2, 3]), torch.tensor([1, 2])
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=ids, lengths=lengths)
    jt = JaggedTensor(values=ids, lengths=lengths)
    kt = KeyedTensor(keys=["a"], length_per_key=[2], values=torch.zeros(3, 2))
    assert kjt.device() == jt.device() == kt.device() == torch.device("cpu")
    assert kjt.to(META).device() == META


def test_kjt_built_on_meta_infers_stride_and_prints_without_data() -> None:
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.empty(7, dtype=torch.int64, device=META),
                            lengths=torch.empty(6, dtype=torch.int32, device=META))
    assert kjt.device() == META and kjt.stride() == 3 and kjt.keys() == ["a", "b"]
    assert repr(kjt) == "KeyedJaggedTensor(keys=['a', 'b'], stride=3, device='meta')"
    assert str(kjt) == repr(kjt) + "\n"
