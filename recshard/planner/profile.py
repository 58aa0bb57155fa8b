"""A machine's measured costs (`CalibrationProfile`), as `recshard-plan calibrate` writes them.

Kernel costs are least-squares fits of measured milliseconds against the work of one call:
`ms = ms_per_id ids + ms_per_bag bags + ms_per_element elements + ms_per_call`, where
`elements` are what the update touches: the whole table for the dense kernel, the distinct
rows looked up times the dim for the fused one (`distinct_rows`), and an id's cost depends on
the rows its ids touch: timed on a cache-resident and a cold table (`KernelCost.id_ms`), read
for the fused kernel at the `working_rows` of the ids (skewed ids: a smaller table); one fit
per (kernel, phase, embedding dim); other dims are interpolated linearly (beyond the measured
range: scaled in proportion to the dim). Link costs are `ms = latency_ms + bytes / bandwidth`
fits per collective and link level, where `bytes` is what leaves one rank (the all-to-all
buffer's `(W-1)/W`, a ring reduce-scatter's / all-gather's `(W-1)/W` of its full buffer).
Memory (`MemoryCost`, fused kernel): the peak resident growth building tables, fitted over two
sizes as `factor weights + fixed` (measured: 1.00 x the weights + ~7 MB, built in place with
no per-table transient), and a first training step's peak per id looked up and per output
byte (the output, and its gradient as a real buffer, as the output dist delivers it).
Step overhead (`StepCost`, per sharding type): what one sharding group of a real sharded module
costs per step beyond its kernels' work and its bytes on the links (input / output dist calls,
collective latencies, permutes), `ms = ms_per_group + ms_per_feature features`, and how much
longer a real module's shards take than their kernel and link fits alone: `ms = work_scale
(modelled - modelled update) + element_scale modelled update + ms_per_shard + ms_per_id ids`
per shard on a rank (`modelled update`: the kernels' per-element terms; `work_scale`: the copies,
permutes and caches shared with the other tables; `ms_per_shard`: what each real-sized shard
costs whatever its ids, e.g. a data-parallel table's gradient buffer and its own collectives'
waits; `ms_per_id`: the input dist's work per id looked up, beyond its bytes on the wire).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List

PHASES = ("fwd", "bwd")  # bwd: backward + optimizer update
logger = logging.getLogger(__name__)

STEP_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
# types the step probes do not build, priced with the measured costs of the type they run as:
# table-column-wise shards are column-wise shards placed inside a host (one placed group)
STEP_TYPE_OF = {"table_column_wise": "column_wise"}
LEVELS = ("intra", "inter")


def distinct_rows(rows: float, ids: float) -> float:
    """Expected distinct rows among `ids` uniform draws from `rows` rows (skewed ids hit
    fewer: an upper bound)."""
    return rows * -math.expm1(-ids / rows) if rows > 0 else 0.0


def working_rows(rows: float, touched: float, ids: float) -> float:
    """The table size whose uniform draws touch as few distinct rows as `ids` ids touch in a
    `rows`-row table (`touched`, e.g. from `CacheStatistics`): `rows` for uniform ids, fewer
    for skewed ones, whose hot rows stay in cache as a smaller table's would. The per-id
    cost (`KernelCost.id_ms`) is read at this size. (`distinct_rows` grows with the table:
    bisection in log rows, to 1e-6 of the size.)"""
    if touched >= distinct_rows(rows, ids) or rows <= 1:
        return float(rows)
    low, high = 1.0, float(rows)
    while high > low * (1 + 1e-6):
        middle = math.sqrt(low * high)
        if distinct_rows(middle, ids) < touched:
            low = middle
        else:
            high = middle
    return high


@dataclass
class KernelCost:
    """Fitted cost of one kernel phase at one embedding dim (ms per unit of work). An id
    costs `ms_per_id` in a table of `hot_rows` rows or fewer (its rows stay in cache) and
    `ms_per_id_cold` in one of `cold_rows` or more; in between, interpolated in log rows
    (`id_ms`). Without `ms_per_id_cold` (profiles before it) every id costs `ms_per_id`."""

    kernel: str
    phase: str
    dim: int
    ms_per_id: float
    ms_per_bag: float
    ms_per_element: float = 0.0
    ms_per_call: float = 0.0
    ms_per_id_cold: float | None = None
    hot_rows: int = 0
    cold_rows: int = 0

    def id_ms(self, rows: float) -> float:
        """ms per id looked up in a table (shard) of `rows` rows."""
        if self.ms_per_id_cold is None or rows <= self.hot_rows:
            return self.ms_per_id
        if rows >= self.cold_rows:
            return self.ms_per_id_cold
        w = math.log(rows / self.hot_rows) / math.log(self.cold_rows / self.hot_rows)
        return (1 - w) * self.ms_per_id + w * self.ms_per_id_cold


@dataclass
class LinkCost:
    """Fitted cost of one collective over one link level among `ranks` ranks."""

    collective: str
    level: str
    ranks: int
    gbps: float
    latency_ms: float


@dataclass
class MemoryCost:
    """Measured resident memory of the fused kernel (CPU): peak growth while building, per
    byte of weights (`weight_factor`) and fixed (`build_fixed_bytes`), fitted over two sizes;
    a step's transient peak per id and per byte of pooled output; and the fixed growth of a
    sharded training step per rank, whatever its tables (0: not measured)."""

    weight_factor: float
    bytes_per_id: float
    bytes_per_output_byte: float
    rank_overhead_bytes: float = (
        0.0  # a sharded step's fixed growth per rank (`recshard.calibration.memory`)
    )
    build_fixed_bytes: float = 0.0  # building a process's first fused tables, whatever their size

    def fixed_bytes_per_rank(self) -> float:
        """A rank's fixed growth: the sharded step's where measured, else the build's."""
        return self.rank_overhead_bytes or self.build_fixed_bytes


@dataclass
class StepCost:
    """Fitted per-step overhead of one sharding group of a sharded module, one phase."""

    sharding_type: str
    phase: str
    ms_per_group: float
    ms_per_feature: float
    work_scale: float = 1.0  # a real module's shard time / the kernel and link fits' estimate
    ms_per_shard: float = 0.0  # and what each real-sized shard on a rank adds beyond that
    ms_per_id: float = 0.0  # and each id it looks up
    # the kernels' per-element work's (the update's) scale, apart from the rest's (None:
    # work_scale, as fitted before it)
    element_scale: float | None = None


@dataclass
class StorageCost:
    """Measured rates of the key-value tables' storage (`recshard.calibration.storage`):
    random `row_bytes` rows read from a cold file of `file_bytes` in `directory`, and written
    back durably, GB/s."""

    read_gbps: float
    write_gbps: float
    row_bytes: int
    file_bytes: int
    directory: str

    @property
    def gbps(self) -> float:
        """One rate for a step that reads and writes back as many rows (harmonic mean)."""
        return 2.0 / (1.0 / self.read_gbps + 1.0 / self.write_gbps)


@dataclass
class CalibrationProfile:
    """What `calibrate` measured on one machine: kernel fits, link fits and how it ran."""

    compute_device: str
    torch_threads: int
    world_size: int = 1
    local_world_size: int = 1
    kernels: List[KernelCost] = field(default_factory=list)
    links: List[LinkCost] = field(default_factory=list)
    memory: MemoryCost | None = None
    steps: List[StepCost] = field(default_factory=list)
    seconds: float = 0.0
    host: str = ""
    storage: StorageCost | None = None  # measured with `calibrate --storage DIR`

    def kernel_cost(self, kernel: str, phase: str, dim: int) -> KernelCost | None:
        """The fit for `kernel` / `phase` at `dim`, interpolated between measured dims; None
        when the kernel was not measured."""
        fits = sorted(
            (k for k in self.kernels if k.kernel == kernel and k.phase == phase),
            key=lambda k: k.dim,
        )
        if not fits:
            return None
        if dim <= fits[0].dim or len(fits) == 1:
            base = fits[0] if dim <= fits[0].dim else fits[-1]
            return _scaled(base, dim / base.dim if dim > base.dim else 1.0, dim)
        if dim >= fits[-1].dim:
            return _scaled(fits[-1], dim / fits[-1].dim, dim)
        hi = next(i for i, k in enumerate(fits) if k.dim >= dim)
        a, b = fits[hi - 1], fits[hi]
        w = (dim - a.dim) / (b.dim - a.dim)
        mix = [(1 - w) * x + w * y for x, y in zip(_terms(a), _terms(b))]
        cold = None
        if a.ms_per_id_cold is not None and b.ms_per_id_cold is not None:
            cold = (1 - w) * a.ms_per_id_cold + w * b.ms_per_id_cold
        return KernelCost(
            kernel,
            phase,
            dim,
            *mix,
            ms_per_id_cold=cold,
            hot_rows=min(a.hot_rows, b.hot_rows),
            cold_rows=max(a.cold_rows, b.cold_rows),
        )

    def kernel_ms(
        self,
        kernel: str,
        phase: str,
        dim: int,
        ids: float,
        bags: float,
        elements: float = 0.0,
        rows: float = 0.0,
    ) -> float | None:
        """Estimated ms of one call's variable work (no per-call term) on a table (shard) of
        `rows` rows; None if unmeasured."""
        cost = self.kernel_cost(kernel, phase, dim)
        if cost is None:
            return None
        return ids * cost.id_ms(rows) + bags * cost.ms_per_bag + elements * cost.ms_per_element

    def call_ms(self, kernel: str, dim: int) -> float:
        """Fixed ms of one forward + backward call of `kernel` (0 when unmeasured)."""
        total = 0.0
        for phase in PHASES:
            cost = self.kernel_cost(kernel, phase, dim)
            total += cost.ms_per_call if cost is not None else 0.0
        return total

    def step_ms(self, sharding_type: str, features: int) -> float | None:
        """Measured per-step overhead (forward + backward) of one `sharding_type` group
        serving `features` features; None where that type was not measured."""
        measured = STEP_TYPE_OF.get(sharding_type, sharding_type)
        costs = [c for c in self.steps if c.sharding_type == measured]
        if not costs:
            return None
        return sum(c.ms_per_group + c.ms_per_feature * features for c in costs)

    def _step(self, sharding_type: str, phase: str) -> StepCost | None:
        """The measured step cost of `sharding_type` (`STEP_TYPE_OF`) in `phase`; None where
        not measured."""
        measured = STEP_TYPE_OF.get(sharding_type, sharding_type)
        return next(
            (c for c in self.steps if c.sharding_type == measured and c.phase == phase), None
        )

    def step_ms_phase(self, sharding_type: str, phase: str, features: int) -> float:
        """Measured per-step overhead of one `sharding_type` group in `phase` (0.0 where not
        measured)."""
        cost = self._step(sharding_type, phase)
        return cost.ms_per_group + cost.ms_per_feature * features if cost is not None else 0.0

    def work_scale(self, sharding_type: str, phase: str) -> float:
        """A real module's time for a `sharding_type` shard's work in `phase` over the kernel
        and link fits' estimate (1.0 where not measured)."""
        cost = self._step(sharding_type, phase)
        return cost.work_scale if cost is not None else 1.0

    def element_scale(self, sharding_type: str, phase: str) -> float:
        """A real module's time for the kernels' per-element work (the update) of a
        `sharding_type` shard in `phase` over the kernel fits' (its `work_scale` where not
        fitted apart)."""
        cost = self._step(sharding_type, phase)
        if cost is None:
            return 1.0
        return cost.element_scale if cost.element_scale is not None else cost.work_scale

    def shard_ms(self, sharding_type: str, phase: str, ids: float) -> float:
        """A real module's ms for one `sharding_type` shard on a rank looking up `ids` ids in
        `phase`, beyond its scaled work (0.0 where not measured)."""
        cost = self._step(sharding_type, phase)
        return cost.ms_per_shard + cost.ms_per_id * ids if cost is not None else 0.0

    def link(self, collective: str, level: str) -> LinkCost | None:
        return next(
            (c for c in self.links if c.collective == collective and c.level == level), None
        )

    def gbps(self, level: str) -> float | None:
        """Bandwidth of a link level: its all-to-all fit (what most of the traffic uses)."""
        cost = self.link("all_to_all", level)
        return cost.gbps if cost is not None else None

    def latency_ms(self, collective: str, multi_host: bool) -> float | None:
        """Latency of one collective among the job's ranks (inter-host when it spans hosts)."""
        cost = self.link(collective, "inter" if multi_host else "intra")
        if cost is None and multi_host:
            cost = self.link(collective, "intra")
        return cost.latency_ms if cost is not None else None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> CalibrationProfile:
        data = dict(data)
        try:
            kernels = [KernelCost(**k) for k in data.pop("kernels", [])]
            links = [LinkCost(**c) for c in data.pop("links", [])]
            steps = [StepCost(**c) for c in data.pop("steps", [])]
            memory = data.pop("memory", None)
            storage = data.pop("storage", None)
            profile = cls(
                kernels=kernels,
                links=links,
                steps=steps,
                memory=MemoryCost(**memory) if memory else None,
                storage=StorageCost(**storage) if storage else None,
                **data,
            )
        except TypeError as e:
            raise ValueError(f"not a calibration profile: {e}") from e
        if memory and "build_fixed_bytes" not in memory:
            logger.warning(
                "calibration profile (host %r): its memory costs predate the two-size build "
                "fit: weight_factor %.2f counts fbgemm's import (~55 MB) as weights, and "
                "bytes_per_output_byte misses the output gradient's buffer; memory estimates "
                "from it are off by up to ~30%%: re-run `recshard-plan calibrate`",
                profile.host,
                profile.memory.weight_factor,
            )
        return profile

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> CalibrationProfile:
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object (a calibration profile)")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


def _terms(cost: KernelCost) -> List[float]:
    return [cost.ms_per_id, cost.ms_per_bag, cost.ms_per_element, cost.ms_per_call]


def _scaled(cost: KernelCost, factor: float, dim: int) -> KernelCost:
    """`cost` with its per-id and per-bag terms scaled by `factor` (a wider row)."""
    cold = cost.ms_per_id_cold * factor if cost.ms_per_id_cold is not None else None
    return KernelCost(
        cost.kernel,
        cost.phase,
        dim,
        cost.ms_per_id * factor,
        cost.ms_per_bag * factor,
        cost.ms_per_element,
        cost.ms_per_call,
        cold,
        cost.hot_rows,
        cost.cold_rows,
    )
