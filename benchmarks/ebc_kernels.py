"""Single-process kernel comparison for `benchmarks.ebc`: recshard's fused and dense kernels,
and the fbgemm TBE / `nn.EmbeddingBag` they build on, one training step each."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch
from torch import nn

from benchmarks.ebc_workload import LEARNING_RATE, Sizes
from benchmarks.link import emit
from recshard import KeyedJaggedTensor
from recshard.calibration.kernels import build_lookup
from recshard.lookup import GroupedLookup
from recshard.types import EmbeddingComputeKernel


def bench_kernels(sizes: Sizes, args: argparse.Namespace) -> None:
    """recshard's fused kernel vs its dense kernel, one process, torch's thread count.

    Same ids for all: `kernel_tables` tables of `kernel_rows x dim`, every bag `kernel_pooling`
    ids. One step is forward + backward + update (exact SGD fused in backward; the dense
    kernel takes a `torch.optim.SGD` step). Also, for reference, the libraries underneath:
    one fbgemm TBE for all tables, and `nn.EmbeddingBag` + `torch.optim.SGD`. Alternated per
    repeat; median step time over repeats of `steps`.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    num, rows, dim = sizes.kernel_tables, sizes.kernel_rows, sizes.dim
    batch, pooling = sizes.kernel_batch, sizes.kernel_pooling
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rows, (num, batch * pooling), generator=g)
    offsets = torch.arange(0, num * batch * pooling + 1, pooling)  # every bag `pooling` long
    bag_offsets = torch.arange(0, batch * pooling + 1, pooling)
    kjt = KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(num)],
        values=ids.reshape(-1),
        lengths=torch.full((num * batch,), pooling),
    )

    def lookup(kernel: EmbeddingComputeKernel) -> GroupedLookup:
        return build_lookup(kernel, num, rows, dim, learning_rate=LEARNING_RATE)

    fused, dense = lookup(EmbeddingComputeKernel.FUSED), lookup(EmbeddingComputeKernel.DENSE)
    dense_sgd = torch.optim.SGD(dense.parameters(), lr=LEARNING_RATE)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * num,
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=LEARNING_RATE,
    )
    bags = nn.ModuleList(
        nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True) for _ in range(num)
    )
    bags_sgd = torch.optim.SGD(bags.parameters(), lr=LEARNING_RATE)

    def sgd_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> None:
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    cases: Dict[str, Callable[[], None]] = {
        "recshard_fused": lambda: sgd_step(fused(kjt).sum(), None),
        "recshard_dense": lambda: sgd_step(dense(kjt).sum(), dense_sgd),
        "fbgemm_tbe_fused_exact_sgd": lambda: sgd_step(tbe(ids.reshape(-1), offsets).sum(), None),
        "nn_embeddingbag_torch_sgd": lambda: sgd_step(
            torch.cat([bag(ids[t], bag_offsets) for t, bag in enumerate(bags)], dim=1).sum(),
            bags_sgd,
        ),
    }
    repeat_medians: Dict[str, List[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, step in cases.items():
            for _ in range(args.warmup):
                step()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            repeat_medians[name].append(statistics.median(times))
    results = {name: statistics.median(m) for name, m in repeat_medians.items()}
    for name, step_s in results.items():
        emit(
            dict(
                bench="kernel",
                name=name,
                world_size=1,
                tables=num,
                rows=rows,
                dim=dim,
                batch=batch,
                pooling=pooling,
                steps=args.steps,
                repeats=args.repeats,
                torch_threads=torch.get_num_threads(),
                median_step_ms=round(1e3 * step_s, 2),
                samples_per_s=round(batch / step_s),
                repeat_medians_ms=[round(1e3 * m, 2) for m in repeat_medians[name]],
            )
        )
    for name, dense_name in [
        ("recshard_fused", "recshard_dense"),
        ("recshard_fused", "nn_embeddingbag_torch_sgd"),
        ("fbgemm_tbe_fused_exact_sgd", "nn_embeddingbag_torch_sgd"),
    ]:
        emit(
            dict(
                bench="kernel_ratio",
                name=f"{name}_speedup_vs_{dense_name}",
                value=round(results[dense_name] / results[name], 2),
                target=4.0,
                torch_threads=torch.get_num_threads(),
            )
        )
