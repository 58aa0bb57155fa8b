"""Kernels side by side on torch's threads give exactly what the one-thread lookup gives.

`GroupedLookup` built with 2 threads cuts a fbgemm group into `2 * KERNELS_PER_THREAD`
kernels (at most one per table) and runs them concurrently, forward and backward
(`recshard.lookup.threads`); built with 1 thread it keeps one kernel. Both must produce the same
outputs, the same tables and optimizer states after several fused steps, and the same
per-sample-weight gradients.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, List

import pytest
import torch
from torch import nn

from recshard.lookup.fused_params import ANY_KERNEL, FusedParams, OptimType
from recshard.lookup.grouped import KERNELS_PER_THREAD, GroupedLookup, split_evenly
from recshard.lookup.tables import LocalTable
from recshard.lookup.threads import run_side_by_side
from recshard.modules import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from recshard.types import EmbeddingComputeKernel

needs_fbgemm = pytest.mark.skipif(not ops.fbgemm_available(), reason="fbgemm not importable")
ROWS = 50


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fbgemm_tables(optim: OptimType, pooled: bool, pooling: PoolingType) -> List[LocalTable]:
    """Four fbgemm-eligible tables (dims multiples of 4, one dim for sequences); t0 is read
    by two features."""
    tables = []
    for i, dim in enumerate([4, 8, 12, 4] if pooled else [8] * 4):
        names = [f"t{i}_a", f"t{i}_b"] if i == 0 else [f"t{i}_a"]
        config = (
            EmbeddingBagConfig(
                num_embeddings=ROWS,
                embedding_dim=dim,
                name=f"t{i}",
                feature_names=names,
                pooling=pooling,
            )
            if pooled
            else EmbeddingConfig(
                num_embeddings=ROWS, embedding_dim=dim, name=f"t{i}", feature_names=names
            )
        )
        tables.append(
            LocalTable(
                config,
                ROWS,
                dim,
                0,
                0,
                EmbeddingComputeKernel.FUSED,
                pooling,
                FusedParams.parse({"optimizer": optim, "learning_rate": 0.1}, config.name),
            )
        )
    return tables


def features(tables: List[LocalTable], weighted: bool, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = [f for t in tables for f in t.feature_names]
    lengths = torch.randint(0, 6, (len(keys) * 4,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)  # duplicates included
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)


def build(tables: List[LocalTable], pooled: bool, threads: int, weighted: bool) -> GroupedLookup:
    with torch_threads(threads):
        return GroupedLookup(
            tables, pooled=pooled, device=torch.device("cpu"), is_weighted=weighted
        )


def states(lookup: GroupedLookup) -> List[torch.Tensor]:
    return [
        s for k in lookup.kernels for per_table in k.optimizer_states() for s in per_table.values()
    ]


@needs_fbgemm
@pytest.mark.parametrize("optim", ANY_KERNEL)
@pytest.mark.parametrize("pooled, weighted", [(True, False), (True, True), (False, False)])
def test_two_threads_equal_one_thread(optim: OptimType, pooled: bool, weighted: bool) -> None:
    tables = fbgemm_tables(optim, pooled, PoolingType.SUM)
    serial = build(tables, pooled, 1, weighted)
    parallel = build(tables, pooled, 2, weighted)
    assert len(serial.kernels) == 1 and parallel.side_by_side
    assert len(parallel.kernels) == min(len(tables), 2 * KERNELS_PER_THREAD)
    assert [t.name for t in parallel.tables] == [t.name for t in serial.tables]
    for a, b in zip(serial.table_weights(), parallel.table_weights()):
        b.data.copy_(a.data)
    with torch_threads(2):
        for step in range(3):
            kjt = features(serial.tables, weighted, seed=step)
            out_serial, out_parallel = serial(kjt), parallel(kjt)
            torch.testing.assert_close(out_parallel, out_serial, rtol=0, atol=0)
            grad = torch.randn(out_serial.shape, generator=torch.Generator().manual_seed(10 + step))
            (out_serial * grad).sum().backward()
            (out_parallel * grad).sum().backward()
            for a, b in zip(serial.table_weights(), parallel.table_weights()):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
            for a, b in zip(states(serial), states(parallel)):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert any(
        not torch.equal(w, w0)
        for w, w0 in zip(
            parallel.table_weights(), build(tables, pooled, 1, weighted).table_weights()
        )
    )


@needs_fbgemm
def test_weights_that_need_grad_get_the_serial_gradient() -> None:
    """Per-sample weights with requires_grad: kernels run on the caller's thread, grads flow."""
    tables = fbgemm_tables(OptimType.EXACT_SGD, True, PoolingType.SUM)
    serial, parallel = build(tables, True, 1, True), build(tables, True, 2, True)
    for a, b in zip(serial.table_weights(), parallel.table_weights()):
        b.data.copy_(a.data)
    kjt = features(serial.tables, True, seed=0)
    grads = []
    for lookup in (serial, parallel):
        weights = kjt.weights().clone().requires_grad_()
        out = lookup(
            KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), weights)
        )
        out.sum().backward()
        grads.append(weights.grad)
    assert grads[0] is not None
    torch.testing.assert_close(grads[1], grads[0])


@needs_fbgemm
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_evaluation_modes_reach_the_worker_threads(mode: str) -> None:
    lookup = build(fbgemm_tables(OptimType.EXACT_SGD, True, PoolingType.SUM), True, 2, False)
    kjt = features(lookup.tables, False, seed=0)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with torch_threads(2), context:
        out = lookup(kjt)
    assert out.grad_fn is None and not out.requires_grad
    assert out.is_inference() == (mode == "inference_mode")


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"kernel failed on {x.numel()} ids")


class _Doubles(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def test_an_error_on_a_worker_thread_reaches_the_caller() -> None:
    with torch_threads(2), pytest.raises(ValueError, match="kernel failed on 3 ids"):
        run_side_by_side([_Doubles(), _Fails()], [torch.ones(2), torch.ones(3)], [2, 3])


def test_side_by_side_returns_outputs_in_kernel_order() -> None:
    x = torch.arange(6.0)
    with torch_threads(2):
        outputs = run_side_by_side(
            [_Doubles(), _Doubles(), _Doubles()], list(x.split([1, 2, 3])), [1, 2, 3]
        )
    assert [out.tolist() for out in outputs] == [[0.0], [2.0, 4.0], [6.0, 8.0, 10.0]]


class _Records(nn.Module):
    def __init__(self, name: str, started: List[str]) -> None:
        super().__init__()
        self.name, self.started = name, started

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.started.append(self.name)
        return x


def test_costliest_kernels_start_first() -> None:
    """One thread drains the queue alone: it takes the kernels by cost, most ids first."""
    started: List[str] = []
    kernels = [_Records(name, started) for name in "abc"]
    with torch_threads(1):
        outputs = run_side_by_side(kernels, [torch.ones(1)] * 3, [1, 5, 3])
    assert started == ["b", "c", "a"] and len(outputs) == 3


def test_split_evenly_keeps_order_and_balances_features() -> None:
    tables = fbgemm_tables(OptimType.EXACT_SGD, True, PoolingType.SUM)  # features 2, 1, 1, 1
    runs = split_evenly(tables, 2)
    assert [[t.name for t in run] for run in runs] == [["t0", "t1"], ["t2", "t3"]]
    assert [[t.name for t in run] for run in split_evenly(tables, 8)] == [[t.name] for t in tables]
    assert split_evenly(tables, 1) == [tables]


@needs_fbgemm
def test_dense_kernels_stay_on_the_callers_thread() -> None:
    """Dense weights carry hooks that run collectives (DP averaging, DDP): never on the pool."""
    fused = fbgemm_tables(OptimType.EXACT_SGD, True, PoolingType.SUM)
    dense = [
        LocalTable(
            EmbeddingBagConfig(
                num_embeddings=ROWS,
                embedding_dim=4,
                name=f"d{i}",
                feature_names=[f"d{i}_a"],
                pooling=pooling,
            ),
            ROWS,
            4,
            0,
            0,
            EmbeddingComputeKernel.DENSE,
            pooling,
        )
        for i, pooling in enumerate([PoolingType.SUM, PoolingType.MEAN])
    ]
    lookup = build(fused + dense, True, 2, False)
    assert lookup.side_by_side and sum(k.is_fused for k in lookup.kernels) == 2 * KERNELS_PER_THREAD
    hook_threads: List[str] = []
    for kernel in lookup.kernels:
        for weight in [] if kernel.is_fused else kernel.table_weights():
            weight.register_hook(lambda g: hook_threads.append(threading.current_thread().name))
    with torch_threads(2):
        lookup(features(lookup.tables, False, seed=0)).sum().backward()
    assert hook_threads == [threading.current_thread().name] * 2
