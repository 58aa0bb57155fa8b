"""recshard's own CPU embedding-bag kernel (`recshard.lookup.native_tbe`) against fbgemm's TBE.

    python -m benchmarks.tbe_native                 # the DLRM tables, one thread
    python -m benchmarks.tbe_native --quick         # tiny sizes (smoke test)

One process, one torch thread, the tables and one rank-batch of ids of `benchmarks.tbe_floor`
(the 26 tables of `ebc_workload`, dim 64, per-rank batch x world size, uniform ids), fp32
weights, fused exact row-wise Adagrad, SUM pooling. `--tables` keeps the first N tables
(13: about one rank's share under the DLRM's table-wise plan). Both kernels start from the
same weights; timed (medians of `--steps`, alternating the two kernels step by step): the
forward, and the backward with its fused update (fbgemm: through autograd, as recshard calls
it; native: the C call). After the timed steps, the largest differences of the outputs,
weights and momenta between the two (each took the same steps on the same gradients) are
reported. Every line on stdout is one JSON object.
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
from benchmarks.tbe_floor import EPS, LEARNING_RATE, _tables
from recshard.lookup import native_tbe
from recshard.lookup.huge_pages import huge_page_zeros
from recshard.lookup.kernels import FbgemmFusedKernel
from recshard.modules import DataType
from recshard.sparse import KeyedJaggedTensor


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2, help="ranks the batch comes from")
    parser.add_argument("--tables", type=int, default=26, help="the first N tables")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    if not native_tbe.available():
        raise SystemExit("recshard.lookup._cpu_tbe is not built: pip install -e . first")
    torch.set_num_threads(1)
    sizes = QUICK if args.quick else Sizes()
    rows = table_rows(sizes)[: args.tables]
    pooling = pooling_factors(len(table_rows(sizes)), sizes.max_pooling)[: len(rows)]
    batch = sizes.batch * args.world_size
    values, lengths = batch_tensors(rows, pooling, batch, seed=1, count=1)[0]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [f"cat_{i}" for i in range(len(rows))], values, lengths, stride=batch
    )
    tables = _tables(rows, sizes.dim, DataType.FP32)
    fbgemm = FbgemmFusedKernel(tables, True, tables[0].fused_params.optim, torch.device("cpu"))
    weights = huge_page_zeros(sum(rows) * sizes.dim, torch.float32).view(-1, sizes.dim)
    weights.copy_(torch.cat([w.detach() for w in fbgemm.table_weights()]))
    momentum = huge_page_zeros(weights.size(0), torch.float32)
    row_start = torch.tensor([0] + rows[:-1]).cumsum(0)
    offsets = kjt.offsets().long()
    grads = [torch.randn(batch, sizes.dim * len(rows)) for _ in range(args.steps + 1)]

    def native_forward() -> torch.Tensor:
        return native_tbe.forward(weights, row_start, values, offsets, None, False, batch)

    def native_backward(grad: torch.Tensor) -> None:
        native_tbe.backward_rowwise_adagrad(
            weights, momentum, row_start, values, offsets, None, False, grad, LEARNING_RATE,
            EPS, False,
        )  # fmt: skip

    times: dict = {k: [] for k in ("fbgemm_fwd", "fbgemm_bwd", "native_fwd", "native_bwd")}
    for grad in grads:  # the first step is a warm-up
        start = time.perf_counter()
        out = fbgemm(kjt)
        forward_done = time.perf_counter()
        out.backward(grad)
        fbgemm_done = time.perf_counter()
        native_forward()
        native_forward_done = time.perf_counter()
        native_backward(grad)
        native_done = time.perf_counter()
        times["fbgemm_fwd"].append(forward_done - start)
        times["fbgemm_bwd"].append(fbgemm_done - forward_done)
        times["native_fwd"].append(native_forward_done - fbgemm_done)
        times["native_bwd"].append(native_done - native_forward_done)
    medians = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
    with torch.no_grad():
        fb_weights = torch.cat(fbgemm.table_weights())
        fb_momentum = torch.cat([s["momentum1"] for s in fbgemm.optimizer_states()])
        out_diff = (fbgemm(kjt) - native_forward()).abs().max().item()
    emit(
        dict(
            bench="tbe_native",
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            load_average=[round(x, 2) for x in os.getloadavg()],
            tables=len(rows),
            ids=int(values.numel()),
            batch=batch,
            dim=sizes.dim,
            steps=args.steps,
            **{f"{k}_ms": round(v, 2) for k, v in medians.items()},
            forward_speedup=round(medians["fbgemm_fwd"] / medians["native_fwd"], 2),
            backward_speedup=round(medians["fbgemm_bwd"] / medians["native_bwd"], 2),
            max_output_diff=out_diff,
            max_weight_diff=(fb_weights - weights).abs().max().item(),
            max_momentum_rel_diff=(
                (fb_momentum - momentum).abs() / fb_momentum.abs().clamp(min=1e-12)
            )
            .max()
            .item(),
        )
    )


if __name__ == "__main__":
    main()
