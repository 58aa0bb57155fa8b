"""A quantized state dict in TorchRec's layout loads into the quantized EBC/EC.

TorchRec keeps each integer table as one `uint8 [rows, 16k]` buffer: fbgemm's whole rows
(fp16 scale, fp16 bias, the codes, zero padding to 16 bytes). benchmarks/torchrec_numbers.py
loads TorchRec 1.9.2's own state dict this way; here the layout is pinned by hand."""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from recshard.quant import quantize_embeddings


def _torchrec_rows(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[scale fp16][bias fp16][codes][zeros to a multiple of 16 bytes], one row per row."""
    head = torch.stack([scale, bias], dim=1).contiguous().view(torch.uint8)
    row = torch.cat([head, codes], dim=1)
    pad = -row.size(1) % 16
    return torch.cat([row, torch.zeros(row.size(0), pad, dtype=torch.uint8)], dim=1)


def as_torchrec_layout(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A quantized module's state as TorchRec keeps it: integer tables as whole rows."""
    out = {}
    for key, value in state.items():
        if f"{key}_qscale" in state:
            out[key] = _torchrec_rows(value, state[f"{key}_qscale"], state[f"{key}_qbias"])
        elif not key.endswith(("_qscale", "_qbias")):
            out[key] = value
    return out


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], torch.tensor([1, 5, 7, 2, 0, 9]), torch.tensor([2, 1, 0, 3])
    )


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint4x2, torch.quint2x4])
@pytest.mark.parametrize("bags", [True, False])
def test_torchrec_rows_load_into_the_quantized_module(dtype: torch.dtype, bags: bool) -> None:
    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        if bags:
            configs = [
                EmbeddingBagConfig(
                    name="t0", embedding_dim=8, num_embeddings=10, feature_names=["f0"]
                ),
                EmbeddingBagConfig(
                    name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]
                ),
            ]
            return quantize_embeddings(torch.nn.Sequential(EmbeddingBagCollection(configs)), dtype)
        configs = [
            EmbeddingConfig(name=t, embedding_dim=8, num_embeddings=10, feature_names=[f])
            for t, f in [("t0", "f0"), ("t1", "f1")]
        ]
        return quantize_embeddings(torch.nn.Sequential(EmbeddingCollection(configs)), dtype)

    reference, fresh = make(0), make(1)
    saved = as_torchrec_layout(reference.state_dict())
    assert all(v.size(1) % 16 == 0 for v in saved.values())
    fresh.load_state_dict(saved)
    for key, value in reference.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    if bags:
        assert torch.equal(fresh(_kjt()).values(), reference(_kjt()).values())
    else:
        out, expected = fresh(_kjt()), reference(_kjt())
        assert all(torch.equal(out[k].values(), expected[k].values()) for k in expected)


def test_rows_of_another_width_are_refused_naming_the_key() -> None:
    configs = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10, feature_names=["f0"])
    ]
    module = quantize_embeddings(torch.nn.Sequential(EmbeddingBagCollection(configs)), torch.qint8)
    with pytest.raises(RuntimeError, match="embedding_bags.t0.weight"):
        module.load_state_dict(
            {"0.embedding_bags.t0.weight": torch.zeros(10, 12, dtype=torch.uint8)}
        )
