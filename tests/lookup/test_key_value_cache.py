"""The key-value kernel's write-back cache against the in-memory torch fused kernel, one
process: a cache of 4 rows on a 64-row table, batches that evict every updated row and read it
back later, so each row makes several round trips through storage. Every test runs with the
cache's books kept by the C++ library (`native_row_cache`) and by its torch fallback, and with
the lookups and updates in recshard's C++ kernel where it covers the optimizer and in torch
(`RECSHARD_NATIVE_KERNEL=0`); the oracle is the in-memory kernel the library builds for the
same tables (`NativeFusedKernel` where it covers them, else `TorchFusedKernel`)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from recshard import EmbeddingBagConfig, KeyedJaggedTensor
from recshard.lookup import native_kernel, native_row_cache
from recshard.lookup.fused_params import FusedParams
from recshard.lookup.kernels import TorchFusedKernel
from recshard.lookup.key_value import CacheOverflowError, KeyValueKernel
from recshard.lookup.native_kernel import NativeFusedKernel
from recshard.lookup.tables import LocalTable
from recshard.types import EmbeddingComputeKernel

ROWS, DIM = 64, 5


@pytest.fixture(params=["native", "torch"], autouse=True)
def books(request, monkeypatch) -> str:  # noqa: ANN001
    """Which path keeps the caches' books (kernels built inside the test take it)."""
    if request.param == "native" and not native_row_cache.available():
        pytest.skip("recshard.lookup._row_cache is not built")
    if request.param == "torch":
        monkeypatch.setattr(native_row_cache, "available", lambda: False)
    return request.param


@pytest.fixture(params=["native", "torch"], autouse=True)
def math(request, monkeypatch) -> str:  # noqa: ANN001
    """Which kernel does the lookups and updates, in memory and on the cache."""
    if request.param == "torch":
        monkeypatch.setenv(native_kernel.ENV, "0")
    return request.param


def _kernels(optimizer: str, directory: str, cached_rows: int = 4) -> tuple:
    fused = {
        "optimizer": optimizer,
        "learning_rate": 0.1,
        "ssd_storage_directory": directory,
        "cache_load_factor": cached_rows / ROWS,
    }
    params = FusedParams.parse(fused, "t")
    config = EmbeddingBagConfig(
        num_embeddings=ROWS, embedding_dim=DIM, name="t", feature_names=["f"]
    )

    def table(kind: EmbeddingComputeKernel) -> LocalTable:
        return LocalTable(config, ROWS, DIM, 0, 0, kind, config.pooling, params)

    torch.manual_seed(0)
    fused = [table(EmbeddingComputeKernel.FUSED)]
    in_memory = (
        NativeFusedKernel
        if native_kernel.covers(fused, True, params.optim, torch.device("cpu"))
        else TorchFusedKernel
    )
    memory = in_memory(fused, True, params.optim, torch.device("cpu"))
    kv = KeyValueKernel(
        [table(EmbeddingComputeKernel.KEY_VALUE)], True, params.optim, torch.device("cpu")
    )
    with torch.no_grad():
        kv.table_weights()[0].copy_(memory.table_weights()[0])
    return memory, kv


@pytest.mark.parametrize("optimizer", ["exact_sgd", "exact_adagrad", "exact_row_wise_adagrad"])
def test_write_back_cache_equals_in_memory(optimizer: str, books: str, math: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        memory, kv = _kernels(optimizer, directory)
        assert kv.caches[0].native == (books == "native")
        assert kv.native == (math == "native" and optimizer != "exact_adagrad")
        for step in range(12):
            ids = torch.tensor([(step * 3 + k) % 16 for k in range(3)] + [step % 2])
            features = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([2, 2]))
            out, kv_out = memory(features), kv(features)
            assert torch.equal(kv_out, out)  # the same rows summed in the same order
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            (out * grad).sum().backward()
            (kv_out * grad).sum().backward()
        assert kv.hit_rate() < 0.5  # rows left the 4-row cache and came back from storage
        assert torch.equal(kv.table_weights()[0], memory.table_weights()[0])
        for name, value in memory.optimizer_states()[0].items():
            assert torch.equal(kv.optimizer_states()[0][name], value)


def test_clock_keeps_a_row_in_use_and_overflow_changes_nothing() -> None:
    """A row read every other step stays cached while cold rows stream through (second chance:
    first in, first out would evict it after 12 newer rows); a batch needing more slots than
    are free raises and leaves the cache as it was."""
    with tempfile.TemporaryDirectory() as directory:
        _, kv = _kernels("exact_row_wise_adagrad", directory, cached_rows=12)
        cache = kv.caches[0]
        cold = iter(range(1, ROWS))
        for step in range(20):
            ids = [next(cold), next(cold)] + ([0] if step % 2 == 0 else [])
            features = KeyedJaggedTensor.from_lengths_sync(
                ["f"], torch.tensor(ids), torch.tensor([len(ids)])
            )
            kv(features).sum().backward()
        assert cache.misses == 1 + 2 * 20  # row 0 came from storage once
        before = (cache.row_slot.clone(), cache.slot_row.clone(), cache.hand)
        too_many = torch.arange(40, 40 + cache.capacity + 1)
        features = KeyedJaggedTensor.from_lengths_sync(
            ["f"], too_many, torch.tensor([too_many.numel()])
        )
        with pytest.raises(CacheOverflowError, match="raise cache_load_factor"):
            kv.prefetch(features)
        assert torch.equal(cache.row_slot, before[0]) and torch.equal(cache.slot_row, before[1])
        assert cache.hand == before[2]


def test_a_failed_write_back_raises_naming_the_table() -> None:
    """A write-back that fails behind the step is not dropped: the next step raises it, naming
    the table and its file (here the file's descriptor is replaced by a read-only one of the
    same file, so `pwrite` fails as on a broken device)."""
    with tempfile.TemporaryDirectory() as directory:
        _, kv = _kernels("exact_adagrad", directory)
        store = kv.caches[0].store
        read_only = os.open(store.paths["weight"], os.O_RDONLY)
        os.close(store._fds["weight"])
        store._fds["weight"] = read_only
        with pytest.raises(RuntimeError, match=r"table 't': writing rows of .*weight' failed"):
            for step in range(8):  # updated rows are evicted from the 4-row cache
                ids = torch.tensor([4 * step, 4 * step + 1])
                features = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([2]))
                kv(features).sum().backward()
