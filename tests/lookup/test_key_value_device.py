"""The key-value kernel runs on the CPU only (its rows live in host memory and files): built
for any other device it refuses with the table and the device named, before any storage is
made. `torch.device("cuda")` needs no GPU to name."""

from __future__ import annotations

import pytest
import torch

from recshard import EmbeddingBagConfig
from recshard.lookup.fused_params import FusedParams
from recshard.lookup.key_value import KeyValueKernel
from recshard.lookup.tables import LocalTable
from recshard.types import EmbeddingComputeKernel


@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_key_value_kernel_refuses_a_device_other_than_cpu(device: str, tmp_path) -> None:  # noqa: ANN001
    params = FusedParams.parse(
        {"optimizer": "exact_sgd", "learning_rate": 0.1, "ssd_storage_directory": str(tmp_path)},
        "t",
    )
    config = EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="t", feature_names=["f"])
    table = LocalTable(config, 8, 4, 0, 0, EmbeddingComputeKernel.KEY_VALUE, config.pooling, params)
    with pytest.raises(ValueError, match=f"table 't'.*key_value.*got device {device}"):
        KeyValueKernel([table], True, params.optim, torch.device(device))
    assert not any(tmp_path.iterdir())  # refused before any storage was made
