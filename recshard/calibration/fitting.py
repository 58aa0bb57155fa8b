"""Pure fitting of calibration measurements (no measuring here): non-negative least squares
of kernel, memory, link and step timings into the costs a `CalibrationProfile` carries."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

Sample = Tuple[float, float, float, float]  # ids, bags, elements, ms


def fit_nonnegative(
    x: Sequence[Sequence[float]], ms: Sequence[float], intercept: bool = True
) -> Tuple[List[float], float]:
    """Non-negative least squares of `ms ~ x . coef + per_call`, weighted by `1 / sqrt(ms)`:
    per-id costs grow with the working set (caches), and the large calls are what a training
    step is made of; a negative coefficient is dropped and the rest refitted (where the last
    work term left is negative, the per-call term goes instead: alone, it would price any
    amount of work at 0 ms). A term no point has gets 0. (coef, per_call)."""
    width = len(x[0])
    columns = [c for c in range(width) if any(row[c] for row in x)]
    columns += [width] if intercept else []
    if not columns:
        return [0.0] * width, 0.0
    y = torch.tensor(list(ms), dtype=torch.float64)
    weight = 1.0 / y.clamp_min(1e-3).sqrt()
    full = torch.tensor([list(row) + [1.0] for row in x], dtype=torch.float64)
    while True:
        coef = torch.linalg.lstsq(
            full[:, columns] * weight[:, None], (y * weight)[:, None]
        ).solution[:, 0]
        negative = [c for c, v in zip(columns, coef.tolist()) if v < 0]
        if not negative or len(columns) == 1:
            break
        drop = negative[0]
        if [c for c in columns if c != width] == [drop] and width in columns:
            drop = width
        columns = [c for c in columns if c != drop]
    values = [0.0] * (width + 1)
    for c, v in zip(columns, coef.tolist()):
        values[c] = max(v, 0.0)
    return values[:width], values[width]


def fit_kernel(x: Sequence[Sequence[float]], ms: Sequence[float]) -> Tuple[List[float], float]:
    """`fit_nonnegative` of a kernel's points, columns (hot-table ids, cold-table ids, bags[,
    elements]). Where one table size's ids come out free and the other's not, that is noise
    (a short calibration's tiny calls), not a cache: both get one price fitted over all ids."""
    coef, per_call = fit_nonnegative(x, ms)
    if (coef[0] == 0.0) != (coef[1] == 0.0):
        merged, per_call = fit_nonnegative([[r[0] + r[1], *r[2:]] for r in x], ms)
        coef = [merged[0], *merged]
    return coef, per_call


def fit_costs(
    points: Sequence[Sample], with_elements: bool, intercept: bool = True
) -> Tuple[float, float, float, float]:
    """(per id, per bag, per element, per call) of `ms ~ ids a + bags b + elements c + d`
    over (ids, bags, elements, ms) points (`fit_nonnegative`)."""
    width = 3 if with_elements else 2
    coef, per_call = fit_nonnegative([p[:width] for p in points], [p[3] for p in points], intercept)
    coef += [0.0] * (3 - width)
    return coef[0], coef[1], coef[2], per_call


def fit_build(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(bytes per byte of weights, fixed bytes) of `build ~ factor weights + fixed` over
    (weights, build growth) points of two or more sizes; the factor is at least 1 (the
    weights are resident once built), the fixed part at least 0."""
    if len({w for w, _ in points}) < 2:
        raise ValueError(f"fit_build needs builds of two or more sizes, got {list(points)}")
    x = torch.tensor([[w, 1.0] for w, _ in points], dtype=torch.float64)
    y = torch.tensor([[b] for _, b in points], dtype=torch.float64)
    factor = max(torch.linalg.lstsq(x, y).solution[0, 0].item(), 1.0)
    fixed = statistics.median(b - factor * w for w, b in points)
    return factor, max(fixed, 0.0)


def fit_rate(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(0 latency, ms per byte over all `points`): for gloo's all-reduce, whose small calls
    take either ~0.3 or ~4 ms here (a median of 7 flips between them), so a fitted latency
    swings 0-3 ms; a step's per-call costs are the step probes' to measure."""
    return 0.0, sum(ms for _, ms in points) / sum(b for b, _ in points)


def fit_link(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(latency ms, ms per byte) of `ms ~ latency + bytes / bw` (relative least squares);
    both kept positive."""
    x = torch.tensor([[1.0, b] for b, _ in points], dtype=torch.float64)
    y = torch.tensor([ms for _, ms in points], dtype=torch.float64)
    weight = 1.0 / y.clamp_min(1e-4)
    latency, per_byte = (
        torch.linalg.lstsq(x * weight[:, None], (y * weight)[:, None]).solution[:, 0].tolist()
    )
    if per_byte <= 0:  # flat timings: all latency; take the largest point's rate
        per_byte = max(ms / b for b, ms in points)
    return max(latency, 0.0), per_byte


@dataclass(frozen=True)
class WorkSample:
    """One real-sized probe module's slowest rank in one phase: the kernel and link fits'
    estimate (`modelled_ms`, of which the kernels' per-element terms, the update, give
    `modelled_update_ms`), the
    shards it holds and ids it looks up, and the measured time beyond the tiny probes'
    overhead (`beyond_ms`)."""

    sharding_type: str
    phase: str
    modelled_ms: float
    shards: float
    ids: float
    beyond_ms: float
    modelled_update_ms: float = 0.0  # the kernels' per-element part of `modelled_ms`


def fit_work(samples: Sequence[WorkSample]) -> Tuple[float, float, float, float]:
    """(scale `s`, update scale `v`, ms per shard `t`, ms per id `u`) of `measured beyond the
    tiny probes' overhead ~ s (modelled - modelled update) + v modelled update + t shards +
    u ids`: non-negative least squares (`fit_nonnegative`, no intercept; a phase without an
    update fits `v` 0). Two scales, because a real module's time over the kernel fits differs
    between the update (data-parallel's whole tables: gradients zeroed, all-reduced, stepped
    by the dense optimizer) and the lookups, and workloads mix them differently. (1, 1, 0, 0)
    where it leaves nothing."""
    usable = [s for s in samples if s.beyond_ms > 0]
    if not usable:
        return 1.0, 1.0, 0.0, 0.0
    coef, _ = fit_nonnegative(
        [
            [s.modelled_ms - s.modelled_update_ms, s.modelled_update_ms, s.shards, s.ids]
            for s in usable
        ],
        [s.beyond_ms for s in usable],
        intercept=False,
    )
    if not any(coef):
        return 1.0, 1.0, 0.0, 0.0
    scale, element_scale, per_shard, per_id = coef
    return scale, element_scale, per_shard, per_id
