"""torch.export of an unsharded EBC model and of its quantized twin: the exported program
gives the eager model's outputs, also on inputs it was not traced with."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from recshard.quant import QuantEmbeddingBagCollection, quantize_embeddings


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]
                ),
                EmbeddingBagConfig(
                    name="t1",
                    embedding_dim=8,
                    num_embeddings=7,
                    feature_names=["f2"],
                    pooling=PoolingType.MEAN,
                ),
            ]
        )
        self.over = nn.Linear(16, 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.ebc(features).values()) + dense.sum(1, keepdim=True)


def _kjt(seed: int) -> KeyedJaggedTensor:
    """Batch 2, 9 ids in all, split over the features differently for each seed."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.zeros(6, dtype=torch.int64)
    for slot in torch.randint(0, 6, (9,), generator=g).tolist():
        lengths[slot] += 1
    rows = [10, 10, 10, 10, 7, 7]
    values = torch.cat(
        [torch.randint(0, rows[i], (int(n),), generator=g) for i, n in enumerate(lengths)]
    )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=values, lengths=lengths
    )


@pytest.mark.parametrize("quantized", [False, True])
def test_exported_program_matches_eager(quantized: bool) -> None:
    torch.manual_seed(0)
    model = _Model().eval()
    if quantized:
        model = quantize_embeddings(copy.deepcopy(model), torch.qint8, inplace=False)
        assert isinstance(model.ebc, QuantEmbeddingBagCollection)
    dense = torch.randn(2, 3)
    exported = torch.export.export(model, (dense, _kjt(0)), strict=False)
    program = exported.module()
    for seed in (0, 1, 2):
        features = _kjt(seed)
        with torch.no_grad():
            torch.testing.assert_close(program(dense, features), model(dense, features))
