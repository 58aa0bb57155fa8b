"""Where fbgemm's CPU TBE spends the step, against the memory floor and a pure-torch twin.

    python -m benchmarks.tbe_floor                 # the DLRM tables, one thread
    python -m benchmarks.tbe_floor --quick         # tiny sizes (smoke test)

One process, one torch thread, the 26 tables of `ebc_workload` (dim 64, rows capped at 200 k)
in one fused kernel, one rank-batch of ids (per-rank batch x world size, uniform ids, the
pooling factors of `ebc_workload`), fused row-wise Adagrad. Timed (medians of `--steps`):

- `fbgemm_forward` / `fbgemm_backward`: recshard's `FbgemmFusedKernel` (the backward holds the
  fused update), fp32 and fp16 weights.
- the same step in torch ops, piece by piece, each the way a kernel could do it:
  `linearize` (table offsets added to the ids), `sort` (the ids sorted, bag of each id),
  `segment_sum` (each distinct row's gradient summed from its bags' output gradients with an
  embedding-bag over the sorted bag ids: no `[ids, D]` gradient materialised), `update` (the
  row-wise Adagrad step on the distinct rows: gather, compute, scatter of weights and state),
  and `torch_forward` (one embedding-bag over the linearized ids).
- the floors at the measured sequential copy bandwidth (GB/s of bytes read plus written):
  forward reads every looked-up row; the backward reads its bag's fp32 output gradient row
  once per id (`grad_gather`, whatever the weights' dtype), sorts the ids (a radix sort's
  passes over keys and values) and reads and writes each distinct row and its accumulator
  once (`update`). On the DLRM rank-batch 24% of the ids are distinct, so the update's floor
  is a quarter of "every lookup read and written" (`ebc_workload.floor_ms`'s rule).

Every line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from benchmarks.compare_torchrec import emit
from benchmarks.ebc_workload import (
    QUICK,
    Sizes,
    batch_tensors,
    copy_bandwidth_gbs,
    pooling_factors,
    table_rows,
)
from recshard.lookup.fused_params import FusedParams
from recshard.lookup.kernels import FbgemmFusedKernel
from recshard.lookup.tables import LocalTable
from recshard.modules import DataType, EmbeddingBagConfig, PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.types import EmbeddingComputeKernel

LEARNING_RATE = 0.01
EPS = 1e-8
SORT_PASSES = 4  # bytes of ids read + written per id by a sort, in units of one id's bytes


def _median_ms(fn: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def _tables(
    rows: List[int],
    dim: int,
    data_type: DataType,
    optimizer: str = "exact_row_wise_adagrad",
    pooling: PoolingType = PoolingType.SUM,
) -> List[LocalTable]:
    fused = FusedParams.parse(
        {"optimizer": optimizer, "learning_rate": LEARNING_RATE, "eps": EPS}, "t"
    )
    return [
        LocalTable(
            EmbeddingBagConfig(
                num_embeddings=n,
                embedding_dim=dim,
                name=f"t{i}",
                feature_names=[f"cat_{i}"],
                data_type=data_type,
            ),
            n,
            dim,
            0,
            0,
            EmbeddingComputeKernel.FUSED,
            pooling,
            fused,
        )
        for i, n in enumerate(rows)
    ]


def time_fbgemm(
    rows: List[int], dim: int, kjt: KeyedJaggedTensor, data_type: DataType, steps: int
) -> Dict[str, float]:
    """Forward and backward (+ fused update) of recshard's fbgemm kernel, ms."""
    tables = _tables(rows, dim, data_type)
    kernel = FbgemmFusedKernel(tables, True, tables[0].fused_params.optim, torch.device("cpu"))
    grad = torch.randn(kjt.stride(), dim * len(rows))
    forward = _median_ms(lambda: kernel(kjt), steps)
    outputs = [kernel(kjt) for _ in range(steps + 1)]
    backward = _median_ms(lambda: outputs.pop().backward(grad), steps)
    return {"forward_ms": forward, "backward_ms": backward}


def time_torch_pieces(
    rows: List[int], dim: int, kjt: KeyedJaggedTensor, steps: int
) -> Dict[str, float]:
    """The same step in torch ops, piece by piece (module docstring), fp32 weights, ms."""
    batch, features = kjt.stride(), len(rows)
    weight = torch.rand(sum(rows), dim) * 0.01
    momentum = torch.zeros(sum(rows))
    table_start = torch.tensor([0] + rows[:-1]).cumsum(0)
    lengths = kjt.lengths().long()
    ids = kjt.values().long()
    bag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    grad = torch.randn(batch, features * dim)

    def linearize() -> torch.Tensor:
        per_feature = lengths.view(features, batch).sum(1)
        return ids + table_start.repeat_interleave(per_feature)

    linear = linearize()
    bag_of_id = torch.arange(features * batch).repeat_interleave(lengths)

    def sort() -> tuple:
        sorted_ids, order = torch.sort(linear, stable=True)
        unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        return unique, counts, bag_of_id.index_select(0, order)

    unique, counts, sorted_bags = sort()
    segment_offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])

    def bag_grads() -> torch.Tensor:  # [F B, D], bags feature-major as the ids
        return grad.view(batch, features, dim).transpose(0, 1).reshape(features * batch, dim)

    def segment_sum() -> torch.Tensor:
        return F.embedding_bag(
            sorted_bags, bag_grads(), segment_offsets, mode="sum", include_last_offset=True
        )

    row_grad = segment_sum()

    def update() -> None:
        m = momentum.index_select(0, unique) + (row_grad * row_grad).mean(dim=1)
        momentum.index_copy_(0, unique, m)
        weight.index_add_(0, unique, (-LEARNING_RATE / (m.sqrt() + EPS)).unsqueeze(1) * row_grad)

    def forward() -> torch.Tensor:
        return F.embedding_bag(linear, weight, bag_offsets, mode="sum", include_last_offset=True)

    return {
        "linearize_ms": _median_ms(linearize, steps),
        "sort_ms": _median_ms(sort, steps),
        "segment_sum_ms": _median_ms(segment_sum, steps),
        "update_ms": _median_ms(update, steps),
        "torch_forward_ms": _median_ms(forward, steps),
        "distinct_rows": int(unique.numel()),
    }


def floors_ms(ids: int, distinct: int, dim: int, weight_bytes: int, bandwidth_gbs: float) -> dict:
    """Memory floors (module docstring) at `bandwidth_gbs`, ms."""
    row = dim * weight_bytes
    to_ms = 1e3 / (bandwidth_gbs * 1e9)
    return {
        "forward_floor_ms": ids * (row + 8) * to_ms,
        "grad_gather_floor_ms": ids * dim * 4 * to_ms,
        "update_floor_ms": distinct * 2 * (row + 4) * to_ms,
        "sort_floor_ms": ids * 8 * SORT_PASSES * to_ms,
    }


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2, help="ranks the batch comes from")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = QUICK if args.quick else Sizes()
    rows = table_rows(sizes)
    pooling = pooling_factors(len(rows), sizes.max_pooling)
    batch = sizes.batch * args.world_size
    values, lengths = batch_tensors(rows, pooling, batch, seed=1, count=1)[0]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [f"cat_{i}" for i in range(len(rows))], values, lengths, stride=batch
    )
    bandwidth = copy_bandwidth_gbs()
    emit(
        dict(
            bench="tbe_floor_setup",
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            load_average=os.getloadavg(),
            copy_bandwidth_gbs=round(bandwidth, 2),
            ids=int(values.numel()),
            batch=batch,
            dim=sizes.dim,
            rows=sum(rows),
        )
    )
    pieces = time_torch_pieces(rows, sizes.dim, kjt, args.steps)
    for data_type, weight_bytes in ((DataType.FP32, 4), (DataType.FP16, 2)):
        fbgemm = time_fbgemm(rows, sizes.dim, kjt, data_type, args.steps)
        floors = floors_ms(
            values.numel(), pieces["distinct_rows"], sizes.dim, weight_bytes, bandwidth
        )
        emit(
            dict(
                bench="tbe_floor",
                weights=data_type.value,
                **{f"fbgemm_{k}": round(v, 2) for k, v in fbgemm.items()},
                **{k: round(v, 2) for k, v in floors.items()},
                backward_over_floor=round(
                    fbgemm["backward_ms"]
                    / sum(
                        floors[k]
                        for k in ("grad_gather_floor_ms", "update_floor_ms", "sort_floor_ms")
                    ),
                    2,
                ),
                forward_over_floor=round(fbgemm["forward_ms"] / floors["forward_floor_ms"], 2),
            )
        )
    emit(
        dict(
            bench="tbe_floor_torch_pieces",
            weights="FP32",
            **{k: round(v, 2) if isinstance(v, float) else v for k, v in pieces.items()},
        )
    )


if __name__ == "__main__":
    main()
