"""The key-value kernel's write-back cache against the in-memory torch fused kernel, one
process: a cache of 4 rows on a 64-row table, batches that evict every updated row and read it
back later, so each row makes several round trips through storage."""

from __future__ import annotations

import tempfile

import pytest
import torch

from recshard import EmbeddingBagConfig, KeyedJaggedTensor
from recshard.lookup.fused_params import FusedParams
from recshard.lookup.kernels import TorchFusedKernel
from recshard.lookup.key_value import KeyValueKernel
from recshard.lookup.tables import LocalTable
from recshard.types import EmbeddingComputeKernel

ROWS, DIM = 64, 5


def _kernels(optimizer: str, directory: str) -> tuple:
    fused = {
        "optimizer": optimizer,
        "learning_rate": 0.1,
        "ssd_storage_directory": directory,
        "cache_load_factor": 4 / ROWS,
    }
    params = FusedParams.parse(fused, "t")
    config = EmbeddingBagConfig(
        num_embeddings=ROWS, embedding_dim=DIM, name="t", feature_names=["f"]
    )

    def table(kind: EmbeddingComputeKernel) -> LocalTable:
        return LocalTable(config, ROWS, DIM, 0, 0, kind, config.pooling, params)

    torch.manual_seed(0)
    memory = TorchFusedKernel(
        [table(EmbeddingComputeKernel.FUSED)], True, params.optim, torch.device("cpu")
    )
    kv = KeyValueKernel(
        [table(EmbeddingComputeKernel.KEY_VALUE)], True, params.optim, torch.device("cpu")
    )
    with torch.no_grad():
        kv.table_weights()[0].copy_(memory.table_weights()[0])
    return memory, kv


@pytest.mark.parametrize("optimizer", ["exact_sgd", "exact_adagrad", "exact_row_wise_adagrad"])
def test_write_back_cache_equals_in_memory(optimizer: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        memory, kv = _kernels(optimizer, directory)
        for step in range(12):
            ids = torch.tensor([(step * 3 + k) % 16 for k in range(3)] + [step % 2])
            features = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([2, 2]))
            out, kv_out = memory(features), kv(features)
            torch.testing.assert_close(kv_out, out, atol=1e-6, rtol=0)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            (out * grad).sum().backward()
            (kv_out * grad).sum().backward()
        assert kv.hit_rate() < 0.5  # rows left the 4-row cache and came back from storage
        torch.testing.assert_close(kv.table_weights()[0], memory.table_weights()[0])
        for name, value in memory.optimizer_states()[0].items():
            torch.testing.assert_close(kv.optimizer_states()[0][name], value)
