"""QuantConfig and torch.quantization.quantize_dynamic, as in TorchRec's tutorial: the mapped
EBC/EC become recshard's quantized twins with the qconfig's storage and output dtypes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.quantization import PlaceholderObserver, QConfig, quantize_dynamic

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from recshard.modules.embedding_configs import DataType
from recshard.quant import QuantConfig, QuantEmbeddingBagCollection, QuantEmbeddingCollection


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=10, embedding_dim=8, name="t0", feature_names=["f0"]
                ),
                EmbeddingBagConfig(
                    num_embeddings=6, embedding_dim=4, name="t1", feature_names=["f1"]
                ),
            ]
        )
        self.ec = EmbeddingCollection(
            [
                EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="s0", feature_names=["g0"]),
            ]
        )
        self.over = nn.Linear(12, 1)

    def forward(self, bags: KeyedJaggedTensor, seqs: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.ebc(bags).values()).sum() + self.ec(seqs)["g0"].values().sum()


def inputs() -> tuple:
    bags = KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], torch.tensor([1, 9, 3, 0, 5]), torch.tensor([2, 1, 1, 1])
    )
    seqs = KeyedJaggedTensor.from_lengths_sync(
        ["g0"], torch.tensor([4, 0, 2]), torch.tensor([1, 2])
    )
    return bags, seqs


def observer(dtype: torch.dtype) -> object:
    return PlaceholderObserver.with_args(dtype=dtype)


def test_quantize_dynamic_maps_ebc_and_ec_to_quantized_twins() -> None:
    model = Model()
    qconfig = QuantConfig(
        activation=observer(torch.float16),
        weight=observer(torch.quint4x2),
        per_table_weight_dtype={"t1": torch.qint8},
    )
    quantized = quantize_dynamic(
        model,
        qconfig_spec={EmbeddingBagCollection: qconfig, EmbeddingCollection: qconfig},
        mapping={
            EmbeddingBagCollection: QuantEmbeddingBagCollection,
            EmbeddingCollection: QuantEmbeddingCollection,
        },
        inplace=False,
    )
    assert type(model.ebc) is EmbeddingBagCollection  # inplace=False leaves the original
    assert isinstance(quantized.ebc, QuantEmbeddingBagCollection)
    assert isinstance(quantized.ec, QuantEmbeddingCollection)
    assert type(quantized.over) is nn.Linear  # not in qconfig_spec: untouched
    assert [c.data_type for c in quantized.ebc.embedding_bag_configs()] == [
        DataType.INT4,
        DataType.INT8,
    ]
    assert quantized.ec.embedding_configs()[0].data_type == DataType.INT4
    bags, seqs = inputs()
    pooled = quantized.ebc(bags)
    assert pooled.values().dtype == torch.float16
    reference = model.ebc(bags).values()
    # INT4 rows: error within half a quantization step per value, summed over the bag
    assert torch.allclose(pooled.values().float(), reference, atol=0.15)
    assert quantized.ec(seqs)["g0"].values().dtype == torch.float16


@pytest.mark.parametrize("weight_dtype", [torch.qint8, torch.quint8, torch.int8])
def test_plain_qconfig_and_explicit_dtype(weight_dtype: torch.dtype) -> None:
    """Every dtype TorchRec reads as INT8 rows (its tutorial asks for torch.int8)."""
    model = Model()
    qconfig = QConfig(activation=PlaceholderObserver, weight=observer(weight_dtype))
    quantize_dynamic(
        model,
        qconfig_spec={EmbeddingBagCollection: qconfig},
        mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection},
        inplace=True,
    )
    assert isinstance(model.ebc, QuantEmbeddingBagCollection)
    assert {c.data_type for c in model.ebc.embedding_bag_configs()} == {DataType.INT8}
    assert model.ebc(inputs()[0]).values().dtype == torch.float32
    # from_float without a qconfig: INT8 rows, float32 output (unchanged default)
    ebc = copy.deepcopy(Model().ebc)
    q = QuantEmbeddingBagCollection.from_float(ebc)
    assert {c.data_type for c in q.embedding_bag_configs()} == {DataType.INT8}


def test_bad_qconfig_dtype_names_the_table() -> None:
    model = Model()
    qconfig = QuantConfig(activation=observer(torch.float), weight=observer(torch.int32))
    with pytest.raises(ValueError, match="table 't0': the quantized embedding kernel cannot store"):
        quantize_dynamic(
            model,
            qconfig_spec={EmbeddingBagCollection: qconfig},
            mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection},
        )
