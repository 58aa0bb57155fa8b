"""DLRM forward/backward shapes and meta construction (unsharded)."""

from __future__ import annotations

import pytest
import torch

from examples.dlrm.data import SyntheticConfig, SyntheticCriteo
from examples.dlrm.model import DLRM, InteractionArch, build_dlrm
from recshard import EmbeddingBagCollection, EmbeddingBagConfig

SIZES = [11, 7, 5, 20]
DIM = 8


def _tables() -> list:
    return [EmbeddingBagConfig(num_embeddings=n, embedding_dim=DIM, name=f"t_cat_{i}",
                               feature_names=[f"cat_{i}"]) for i, n in enumerate(SIZES)]


def _batch(batch_size: int = 6, multi_hot: int = 3):
    config = SyntheticConfig(SIZES, batch_size, multi_hot=multi_hot, seed=3)
    return next(iter(SyntheticCriteo(config)))


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_forward_backward_shapes(interaction: str) -> None:
    torch.manual_seed(0)
    model = build_dlrm(_tables(), 13, [16, DIM], [16, 1], interaction=interaction)
    batch = _batch()
    loss, (loss_d, logits, labels) = model(batch)
    assert loss.dim() == 0 and logits.shape == (6,) and labels.shape == (6,)
    assert not loss_d.requires_grad and not logits.requires_grad
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    ebc_grad = grads["model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"]
    assert ebc_grad.shape == (SIZES[0], DIM)


def test_interaction_is_pairwise_dots() -> None:
    dense = torch.randn(2, 4)
    sparse = torch.randn(2, 3, 4)
    out = InteractionArch(3)(dense, sparse)
    assert out.shape == (2, InteractionArch.output_dim(4, 3)) == (2, 4 + 6)
    vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
    expected = [vectors[:, i] @ vectors[:, j].T for i in range(4) for j in range(i + 1, 4)]
    for k, e in enumerate(expected):
        torch.testing.assert_close(out[:, 4 + k], e.diagonal())
    torch.testing.assert_close(out[:, :4], dense)


def test_builds_on_meta() -> None:
    model = build_dlrm(_tables(), 13, [16, DIM], [16, 1], interaction="dcn", device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_bad_layer_sizes_are_named() -> None:
    ebc = EmbeddingBagCollection(_tables(), device="meta")
    with pytest.raises(ValueError, match="end with the embedding dim 8"):
        DLRM(ebc, 13, [16, 4], [16, 1])
    with pytest.raises(ValueError, match="over arch must end with 1"):
        DLRM(ebc, 13, [16, 8], [16, 2])
    with pytest.raises(ValueError, match="interaction must be"):
        DLRM(ebc, 13, [16, 8], [16, 1], interaction="attention")
