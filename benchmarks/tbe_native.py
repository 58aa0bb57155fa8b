"""recshard's own CPU embedding-bag kernel (`recshard.lookup.native_tbe`) against fbgemm's TBE.

    python -m benchmarks.tbe_native                 # the DLRM tables, one thread
    python -m benchmarks.tbe_native --quick         # tiny sizes (smoke test)

One process, one torch thread, the tables and one rank-batch of ids of `benchmarks.tbe_floor`
(the 26 tables of `ebc_workload`, dim 64, per-rank batch x world size, uniform ids), fp32
weights, fused exact row-wise Adagrad (`--optim sgd`: exact SGD), SUM pooling (`--pooling
mean`: MEAN). `--tables`
keeps the first N tables (13: about one rank's share under the DLRM's table-wise plan),
`--table-list 0,2,3` the tables named (one rank's share under a given plan). Both
kernels start from the
same weights; timed (medians of `--steps`, alternating the two kernels step by step), both
through autograd as the lookup calls them: the forward, and the backward with its fused
update (`FbgemmFusedKernel` vs `NativeFusedKernel`). After the timed steps, the largest
differences of the outputs, weights and momenta between the two (each took the same steps on
the same gradients) are reported. `--forward-cold`: forwards only, without autograd, each after
128 MB written (the caches cold, as after a training step's backward). Every line on stdout is
one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import List

import torch

from benchmarks.ebc_workload import QUICK, Sizes, batch_tensors, pooling_factors, table_rows
from benchmarks.link import emit
from benchmarks.tbe_floor import _tables
from recshard.lookup import native_tbe
from recshard.lookup.kernels import FbgemmFusedKernel
from recshard.lookup.native_kernel import NativeFusedKernel
from recshard.modules import DataType, PoolingType
from recshard.sparse import KeyedJaggedTensor


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2, help="ranks the batch comes from")
    parser.add_argument("--tables", type=int, default=26, help="the first N tables")
    parser.add_argument(
        "--table-list",
        type=lambda text: [int(t) for t in text.split(",")],
        help="these tables instead (comma-separated indices, e.g. one rank's under a plan)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--optim", choices=["rowwise_adagrad", "sgd"], default="rowwise_adagrad")
    parser.add_argument("--pooling", choices=["sum", "mean"], default="sum")
    parser.add_argument(
        "--forward-cold",
        action="store_true",
        help="time forwards only (no grad), the caches flushed (128 MB written) before each",
    )
    args = parser.parse_args(argv)
    if not native_tbe.available():
        raise SystemExit("recshard.lookup._cpu_tbe is not built: pip install -e . first")
    torch.set_num_threads(1)
    sizes = QUICK if args.quick else Sizes()
    picked = args.table_list or list(range(args.tables))
    rows = [table_rows(sizes)[t] for t in picked]
    pooling = [pooling_factors(len(table_rows(sizes)), sizes.max_pooling)[t] for t in picked]
    batch = sizes.batch * args.world_size
    values, lengths = batch_tensors(rows, pooling, batch, seed=1, count=1)[0]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [f"cat_{i}" for i in range(len(rows))], values, lengths, stride=batch
    )
    optimizer = {"rowwise_adagrad": "exact_row_wise_adagrad", "sgd": "exact_sgd"}[args.optim]
    pooling_type = PoolingType.MEAN if args.pooling == "mean" else PoolingType.SUM
    tables = _tables(rows, sizes.dim, DataType.FP32, optimizer, pooling_type)
    spec = tables[0].fused_params.optim
    fbgemm = FbgemmFusedKernel(tables, True, spec, torch.device("cpu"))
    native = NativeFusedKernel(tables, True, spec, torch.device("cpu"))
    for src, dst in zip(fbgemm.table_weights(), native.table_weights()):
        dst.copy_(src.detach())
    grads = [torch.randn(batch, sizes.dim * len(rows)) for _ in range(args.steps + 1)]
    times: dict = {k: [] for k in ("fbgemm_fwd", "fbgemm_bwd", "native_fwd", "native_bwd")}
    flush = torch.ones(32 * 2**20) if args.forward_cold else None
    for grad in grads:  # the first step is a warm-up
        for name, kernel in (("fbgemm", fbgemm), ("native", native)):
            if flush is not None:
                flush.add_(1.0)
                start = time.perf_counter()
                with torch.no_grad():
                    kernel(kjt)
                times[f"{name}_fwd"].append(time.perf_counter() - start)
                continue
            start = time.perf_counter()
            out = kernel(kjt)
            forward_done = time.perf_counter()
            out.backward(grad)
            times[f"{name}_fwd"].append(forward_done - start)
            times[f"{name}_bwd"].append(time.perf_counter() - forward_done)
    medians = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items() if v}
    with torch.no_grad():
        out_diff = (fbgemm(kjt) - native(kjt)).abs().max().item()
    weight_diff = max(
        (a - b).abs().max().item() for a, b in zip(fbgemm.table_weights(), native.table_weights())
    )
    momentum_diff = max(
        (
            ((a["momentum1"] - b["momentum1"]).abs() / a["momentum1"].abs().clamp(min=1e-12))
            .max()
            .item()
            for a, b in zip(fbgemm.optimizer_states(), native.optimizer_states())
            if a
        ),
        default=None,
    )
    emit(
        dict(
            bench="tbe_native",
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            load_average=[round(x, 2) for x in os.getloadavg()],
            tables=len(rows),
            table_list=args.table_list,
            optim=args.optim,
            pooling=args.pooling,
            forward_cold=args.forward_cold,
            ids=int(values.numel()),
            batch=batch,
            dim=sizes.dim,
            steps=args.steps,
            **{f"{k}_ms": round(v, 2) for k, v in medians.items()},
            forward_speedup=round(medians["fbgemm_fwd"] / medians["native_fwd"], 2),
            backward_speedup=None
            if args.forward_cold
            else round(medians["fbgemm_bwd"] / medians["native_bwd"], 2),
            max_output_diff=out_diff,
            max_weight_diff=weight_diff,
            max_momentum_rel_diff=momentum_diff,
        )
    )


if __name__ == "__main__":
    main()
