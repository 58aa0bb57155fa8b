"""The unsharded EBC with a variable batch per feature, as TorchRec 1.8's (checked side by
side): each feature pooled at its own batch size, rows brought to one batch by
`inverse_indices`; without them the batch is refused (TorchRec: a torch.cat size error)."""

from __future__ import annotations

import pytest
import torch

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType


def ebc(weighted: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name="t1", embedding_dim=2, num_embeddings=10, feature_names=["f1", "f2"]
            ),
            EmbeddingBagConfig(
                name="t2",
                embedding_dim=3,
                num_embeddings=10,
                feature_names=["f3"],
                pooling=PoolingType.MEAN,
            ),
        ],
        is_weighted=weighted,
    )


VALUES = torch.tensor([1, 2, 3, 4, 5, 6, 7])
LENGTHS = torch.tensor([2, 1, 1, 1, 0, 2])  # f1: [[1, 2], [3]]; f2: [[4]]; f3: [[5], [], [6, 7]]
INVERSE = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [2, 1, 0, 1]])


def vbe(inverse=(["f1", "f2", "f3"], INVERSE), strides=((2,), (1,), (3,)), weights=None):  # noqa: ANN001
    return KeyedJaggedTensor(
        ["f1", "f2", "f3"],
        VALUES,
        weights,
        lengths=LENGTHS,
        stride_per_key_per_rank=[list(s) for s in strides],
        inverse_indices=inverse,
    )


def by_hand(module: EmbeddingBagCollection) -> torch.Tensor:
    w1, w2 = module.embedding_bags["t1"].weight, module.embedding_bags["t2"].weight
    f1 = torch.stack([w1[1] + w1[2], w1[3]])
    f2 = w1[4].unsqueeze(0)
    f3 = torch.stack([w2[5], torch.zeros(3), (w2[6] + w2[7]) / 2])
    return torch.cat([f1[INVERSE[0]], f2[INVERSE[1]], f3[INVERSE[2]]], dim=1)


def test_each_feature_pooled_at_its_batch_then_expanded() -> None:
    module = ebc()
    out = module(vbe())
    assert out.keys() == ["f1", "f2", "f3"] and out.values().shape == (4, 7)
    expected = by_hand(module)
    torch.testing.assert_close(out.values(), expected)
    grad = torch.randn_like(expected)
    out.values().backward(grad)
    got = {n: b.weight.grad.clone() for n, b in module.embedding_bags.items()}
    module.zero_grad()
    by_hand(module).backward(grad)
    for name, bag in module.embedding_bags.items():
        torch.testing.assert_close(got[name], bag.weight.grad)


def test_inverse_keys_in_any_order_and_batches_from_several_ranks() -> None:
    module = ebc()
    expected = module(vbe()).values()
    reordered = vbe(inverse=(["f3", "f1", "f2"], INVERSE[[2, 0, 1]]))
    torch.testing.assert_close(module(reordered).values(), expected)
    two_ranks = vbe(strides=((1, 1), (1, 0), (2, 1)))
    torch.testing.assert_close(module(two_ranks).values(), expected)


def test_weighted_variable_batch() -> None:
    module = ebc(weighted=True)
    out = module(vbe(weights=torch.ones(7))).values()
    torch.testing.assert_close(out, by_hand(module))


def test_one_batch_with_inverse_indices_is_expanded_too() -> None:
    module = ebc()
    uniform = KeyedJaggedTensor(
        ["f1", "f2", "f3"],
        VALUES,
        lengths=torch.tensor([2, 1, 1, 0, 1, 2]),
        inverse_indices=(["f1", "f2", "f3"], torch.tensor([[0, 1, 1]] * 3)),
    )
    out = module(uniform).values()
    plain = module(
        KeyedJaggedTensor(["f1", "f2", "f3"], VALUES, lengths=uniform.lengths())
    ).values()
    assert out.shape == (3, 7)
    torch.testing.assert_close(out, plain[[0, 1, 1]])


def test_variable_batch_errors_name_the_features() -> None:
    module = ebc()
    with pytest.raises(
        ValueError,
        match=r"different batch sizes \{'f1': 2, 'f2': 1, 'f3': 3\} "
        "and the input has no inverse_indices",
    ):
        module(vbe(inverse=None))
    bad = INVERSE.clone()
    bad[1, 1] = 1  # f2 has a batch of 1
    with pytest.raises(
        ValueError,
        match=r"feature 'f2': inverse index 1 at position 1 is outside "
        "its batch of 1",
    ):
        module(vbe(inverse=(["f1", "f2", "f3"], bad)))
    with pytest.raises(ValueError, match=r"inverse_indices have no rows for features \['f3'\]"):
        module(vbe(inverse=(["f1", "f2"], INVERSE[:2])))
