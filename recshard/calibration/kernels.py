"""Timing recshard's fused and dense lookup kernels (`GroupedLookup`, exact SGD), forward and
backward + update, over a `CalibrationGrid` of embedding dims, pooling factors, batch sizes and
table sizes, each point the median of a few timed calls; one least-squares fit per kernel,
phase and dim (see `recshard.planner.profile`)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

from recshard.calibration.fitting import fit_kernel
from recshard.calibration.grid import CalibrationGrid
from recshard.lookup import GroupedLookup, LocalTable
from recshard.lookup.fused_params import FusedParams
from recshard.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from recshard.planner.profile import KernelCost, distinct_rows
from recshard.sparse import KeyedJaggedTensor
from recshard.types import EmbeddingComputeKernel

LR = 0.01  # the probes' exact SGD learning rate


def build_lookup(
    kernel: EmbeddingComputeKernel, tables: int, rows: int, dim: int, learning_rate: float = LR
) -> GroupedLookup:
    local = [
        LocalTable(
            EmbeddingBagConfig(
                num_embeddings=rows, embedding_dim=dim, name=f"t{t}", feature_names=[f"f{t}"]
            ),
            rows,
            dim,
            0,
            0,
            kernel,
            PoolingType.SUM,
            FusedParams.parse({"optimizer": "exact_sgd", "learning_rate": learning_rate}, f"t{t}"),
        )
        for t in range(tables)
    ]
    return GroupedLookup(local, pooled=True, device=torch.device("cpu"))


def random_batch(tables: int, rows: int, batch: int, pooling: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    return KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(tables)],
        values=torch.randint(0, rows, (tables * batch * pooling,), generator=g),
        lengths=torch.full((tables * batch,), pooling, dtype=torch.int64),
    )


def _median_ms(fn: Callable[[], None], budget_s: float, min_calls: int = 3) -> float:
    fn()  # warm-up
    times: List[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_calls or (time.perf_counter() < deadline and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _time_point(
    lookup: GroupedLookup,
    sgd: torch.optim.Optimizer | None,
    kjt: KeyedJaggedTensor,
    budget_s: float,
) -> Tuple[float, float]:
    """Median ms of a forward, and of a forward + backward + update."""

    def forward() -> None:
        lookup(kjt)

    def step() -> None:
        lookup(kjt).sum().backward()
        if sgd is not None:
            sgd.step()
            sgd.zero_grad(set_to_none=True)

    return _median_ms(forward, budget_s / 2), _median_ms(step, budget_s / 2)


def measure_kernels(dim: int, grid: CalibrationGrid, per_point_s: float) -> List[KernelCost]:
    """Fits for the fused and dense kernels at `dim`, forward and backward + update, each
    timed on tables of the smallest and the largest size of `grid.rows` (cache-resident and
    cold): an id costs `ms_per_id` in the small tables and `ms_per_id_cold` in the large ones.
    The dense update's elements are the whole table; the fused update's, the distinct rows
    looked up times the dim, so one fit prices any table size and batch (a small table's ids
    are mostly repeats)."""
    hot, cold = min(grid.rows), max(grid.rows)
    features: Dict[Tuple[str, str], List[List[float]]] = {}
    times: Dict[Tuple[str, str], List[float]] = {}
    for name, kernel in (
        ("fused", EmbeddingComputeKernel.FUSED),
        ("dense", EmbeddingComputeKernel.DENSE),
    ):
        for rows in (hot, cold):
            lookup = build_lookup(kernel, grid.tables, rows, dim)
            params = [p for p in lookup.parameters() if p.requires_grad]
            sgd = torch.optim.SGD(params, lr=LR) if params else None
            for batch in grid.batches:
                for pooling in grid.poolings:
                    kjt = random_batch(grid.tables, rows, batch, pooling, seed=dim + pooling)
                    fwd, total = _time_point(lookup, sgd, kjt, per_point_s)
                    ids = float(grid.tables * batch * pooling)
                    updated = rows if name == "dense" else distinct_rows(rows, ids / grid.tables)
                    work = [
                        ids if rows == hot else 0.0,
                        ids if rows == cold else 0.0,
                        float(grid.tables * batch),
                        float(grid.tables * updated * dim),
                    ]
                    for phase, ms in (("fwd", fwd), ("bwd", max(total - fwd, 0.0))):
                        features.setdefault((name, phase), []).append(work)
                        times.setdefault((name, phase), []).append(ms)
    out = []
    for (name, phase), x in features.items():
        with_elements = name == "dense" or phase == "bwd"
        coef, per_call = fit_kernel(
            [row if with_elements else row[:3] for row in x], times[(name, phase)]
        )
        per_element = coef[3] if with_elements else 0.0
        out.append(
            KernelCost(
                name,
                phase,
                dim,
                coef[0],
                coef[2],
                per_element,
                per_call,
                ms_per_id_cold=coef[1],
                hot_rows=hot,
                cold_rows=cold,
            )
        )
    return out
