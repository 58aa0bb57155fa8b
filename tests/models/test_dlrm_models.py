"""recshard.models.dlrm: TorchRec's DLRM / DLRM_DCN / DLRMTrain arguments, shapes, state_dict
layout, meta construction and materialization."""

from __future__ import annotations

from typing import List

import pytest
import torch

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.datasets.random import RandomRecDataset
from recshard.models.dlrm import (
    DLRM,
    DLRM_DCN,
    DLRMTrain,
    InteractionArch,
    InteractionDCNArch,
    OverArch,
    SparseArch,
    choose,
)
from recshard.modules.crossnet import LowRankCrossNet
from recshard.modules.mlp import MLP

DIM = 4
KEYS = ["f0", "f1", "f2"]


def _ebc(device: str | None = None, dims: List[int] | None = None) -> EmbeddingBagCollection:
    dims = dims or [DIM] * 2
    tables = [
        EmbeddingBagConfig(
            name="t0", embedding_dim=dims[0], num_embeddings=10, feature_names=["f0", "f1"]
        ),
        EmbeddingBagConfig(
            name="t1", embedding_dim=dims[1], num_embeddings=7, feature_names=["f2"]
        ),
    ]
    return EmbeddingBagCollection(tables=tables, device=device)


def _batch(batch_size: int = 5, seed: int = 0):
    dataset = RandomRecDataset(
        KEYS, batch_size, hash_sizes=[10, 10, 7], num_dense=6, manual_seed=seed, num_batches=1
    )
    return next(iter(dataset))


def test_sparse_arch_orders_features_like_the_configs() -> None:
    ebc = _ebc()
    arch = SparseArch(ebc)
    assert arch.sparse_feature_names == KEYS and (arch.F, arch.D) == (3, DIM)
    kjt = _batch().sparse_features
    out = arch(kjt)
    pooled = ebc(kjt).to_dict()
    assert out.shape == (5, 3, DIM)
    for i, key in enumerate(KEYS):
        torch.testing.assert_close(out[:, i], pooled[key])


def test_interaction_is_dense_then_upper_triangle_of_dots() -> None:
    dense, sparse = torch.randn(2, DIM), torch.randn(2, 3, DIM)
    out = InteractionArch(3)(dense, sparse)
    assert out.shape == (2, DIM + 3 + choose(3, 2))
    vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
    pairs = [(vectors[:, i] * vectors[:, j]).sum(1) for i in range(4) for j in range(i + 1, 4)]
    torch.testing.assert_close(out, torch.cat([dense, torch.stack(pairs, 1)], 1))
    torch.testing.assert_close(InteractionArch(0)(dense, sparse[:, :0]), dense)


def test_interaction_gather_gives_the_bits_of_row_column_indexing() -> None:
    """The triangle read at flat positions equals `gram[:, rows, cols]` (TorchRec's indexing)
    bit for bit, forward and backward (the backward adds each gradient into zeros either way)."""
    torch.manual_seed(0)
    features = 26
    dense = torch.randn(64, 16, requires_grad=True)
    sparse = torch.randn(64, features, 16, requires_grad=True)
    out = InteractionArch(features)(dense, sparse)
    rows, cols = torch.triu_indices(features + 1, features + 1, 1)
    dense_ref = dense.detach().clone().requires_grad_()
    sparse_ref = sparse.detach().clone().requires_grad_()
    vectors = torch.cat([dense_ref.unsqueeze(1), sparse_ref], dim=1)
    gram = torch.bmm(vectors, vectors.transpose(1, 2))
    ref = torch.cat([dense_ref, gram[:, rows, cols]], dim=1)
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(dense.grad, dense_ref.grad) and torch.equal(sparse.grad, sparse_ref.grad)


def test_dcn_interaction_runs_the_crossnet_on_the_concatenation() -> None:
    torch.manual_seed(0)
    crossnet = LowRankCrossNet(4 * DIM, num_layers=2, low_rank=3)
    dense, sparse = torch.randn(2, DIM), torch.randn(2, 3, DIM)
    x0 = torch.cat([dense, sparse.flatten(1)], 1)
    x = x0
    for w, v, b in zip(crossnet.W_kernels, crossnet.V_kernels, crossnet.bias):
        x = x0 * (x @ v.T @ w.T + b) + x
    torch.testing.assert_close(InteractionDCNArch(3, crossnet)(dense, sparse), x)


@pytest.mark.parametrize("variant", ["dot", "dcn"])
def test_train_forward_backward(variant: str) -> None:
    torch.manual_seed(0)
    ebc = _ebc()
    if variant == "dot":
        dlrm: DLRM = DLRM(
            ebc, dense_in_features=6, dense_arch_layer_sizes=[8, DIM], over_arch_layer_sizes=[5, 1]
        )
    else:
        dlrm = DLRM_DCN(
            ebc,
            dense_in_features=6,
            dense_arch_layer_sizes=[8, DIM],
            over_arch_layer_sizes=[5, 1],
            dcn_num_layers=2,
            dcn_low_rank_dim=2,
        )
    batch = _batch()
    loss, (loss_d, logits, labels) = DLRMTrain(dlrm)(batch)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(
        dlrm(batch.dense_features, batch.sparse_features).squeeze(-1), batch.labels.float()
    )
    torch.testing.assert_close(loss, expected)
    assert logits.shape == labels.shape == (5,) and not loss_d.requires_grad
    loss.backward()
    assert all(p.grad is not None for p in dlrm.parameters())


def test_state_dict_keys_are_torchrecs() -> None:
    """TorchRec's layout (`model._mlp.N._linear`, `W_kernels` ...) so its checkpoints load."""
    dot = DLRMTrain(DLRM(_ebc(), 6, [8, DIM], [5, 3, 1])).state_dict()
    dense = [
        "model.dense_arch.model._mlp.0._linear",
        "model.dense_arch.model._mlp.1._linear",
        "model.over_arch.model.0._mlp.0._linear",
        "model.over_arch.model.0._mlp.1._linear",
        "model.over_arch.model.1",
    ]
    tables = [
        "model.sparse_arch.embedding_bag_collection.embedding_bags.t0.weight",
        "model.sparse_arch.embedding_bag_collection.embedding_bags.t1.weight",
    ]
    assert list(dot) == tables + [f"{m}.{p}" for m in dense for p in ("weight", "bias")]
    dcn = DLRM_DCN(_ebc(), 6, [8, DIM], [5, 1], dcn_num_layers=2, dcn_low_rank_dim=3).state_dict()
    cross = {k: tuple(v.shape) for k, v in dcn.items() if k.startswith("inter_arch")}
    n = 4 * DIM
    assert cross == {
        "inter_arch.crossnet.W_kernels.0": (n, 3),
        "inter_arch.crossnet.W_kernels.1": (n, 3),
        "inter_arch.crossnet.V_kernels.0": (3, n),
        "inter_arch.crossnet.V_kernels.1": (3, n),
        "inter_arch.crossnet.bias.0": (n,),
        "inter_arch.crossnet.bias.1": (n,),
    }


def test_meta_build_then_materialize_like_dmp() -> None:
    """Built on meta, every module with meta tensors is `to_empty` + `reset_parameters`
    (what DistributedModelParallel does): nothing is left uninitialized."""
    model = DLRM_DCN(_ebc("meta"), 6, [8, DIM], [5, 1], 2, 2, dense_device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    for module in model.modules():
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if any(t.is_meta for t in own):
            module.to_empty(device="cpu", recurse=False)
            with torch.no_grad():  # garbage in: reset_parameters must overwrite it
                for t in own:
                    if t.is_floating_point():
                        t.fill_(float("nan"))
            module.reset_parameters()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.inter_arch.crossnet.bias) and not any(
        p.abs().sum() for p in model.inter_arch.crossnet.bias
    )
    batch = _batch()
    assert model(batch.dense_features, batch.sparse_features).shape == (5, 1)


def test_dot_interaction_materializes_its_indices_from_meta() -> None:
    with torch.device("meta"):
        arch = InteractionArch(3)
    arch.to_empty(device="cpu")
    arch.reset_parameters()
    torch.testing.assert_close(arch.triu_indices, torch.triu_indices(4, 4, 1))
    torch.testing.assert_close(arch.triu_positions, torch.tensor([1, 2, 3, 6, 7, 11]))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"dimension \(4\) and final dense arch layer size \(5\)"):
        DLRM(_ebc(), 6, [8, 5], [5, 1])
    with pytest.raises(ValueError, match="one embedding_dim"):
        DLRM(_ebc(dims=[4, 8]), 6, [8, 4], [5, 1])
    with pytest.raises(ValueError, match="OverArch must have multiple layers"):
        OverArch(10, [1])
    with pytest.raises(ValueError, match="low_rank must be >= 1"):
        LowRankCrossNet(8, 2, low_rank=0)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        MLP(4, [4], activation="gelu")


def test_mlp_activation_on_last() -> None:
    torch.manual_seed(0)
    mlp = MLP(3, [4, 2], activation="sigmoid", activation_on_last=False)
    x = torch.randn(5, 3)
    first, last = mlp.linears()
    torch.testing.assert_close(mlp(x), last(torch.sigmoid(first(x))))


def test_kjt_key_order_does_not_matter() -> None:
    """The arch reads features by the EBC's config order, whatever order the KJT has."""
    ebc = _ebc()
    kjt = _batch().sparse_features
    permuted = kjt.permute([2, 0, 1])
    assert isinstance(permuted, KeyedJaggedTensor)
    torch.testing.assert_close(SparseArch(ebc)(permuted), SparseArch(ebc)(kjt))
