"""The example's build_dlrm: forward/backward shapes and meta construction (unsharded);
the model classes themselves are tested in tests/models."""

from __future__ import annotations

import pytest
import torch

from examples.dlrm.data import SyntheticConfig, SyntheticCriteo
from examples.dlrm.model import build_dlrm
from recshard import EmbeddingBagConfig
from recshard.models.dlrm import DLRM_DCN

SIZES = [11, 7, 5, 20]
DIM = 8


def _tables() -> list:
    return [
        EmbeddingBagConfig(
            num_embeddings=n, embedding_dim=DIM, name=f"t_cat_{i}", feature_names=[f"cat_{i}"]
        )
        for i, n in enumerate(SIZES)
    ]


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


def test_builds_on_meta() -> None:
    model = build_dlrm(_tables(), 13, [16, DIM], [16, 1], interaction="dcn", device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_interaction_picks_the_model() -> None:
    model = build_dlrm(_tables(), 13, [16, DIM], [16, 1], interaction="dcn", device="meta")
    assert isinstance(model.model, DLRM_DCN)
    with pytest.raises(ValueError, match="interaction must be"):
        build_dlrm(_tables(), 13, [16, DIM], [16, 1], interaction="attention", device="meta")
