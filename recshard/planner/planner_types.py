"""Planner vocabulary: the hardware (`Topology`), per-table knobs (`ParameterConstraints`),
the table metadata the planner works on (`TableMeta`), and the candidates it weighs
(`ShardingOption` made of `Shard`s with `Perf` and `Storage`).

Units: memory in bytes, time in milliseconds, bandwidths given in GB/s (1e9 bytes/s) and
stored in bytes/ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from recshard.modules.embedding_configs import DataType
from recshard.plan import sharding_types
from recshard.plan.sharding_types import sharding_type_values
from recshard.planner.cache_params_json import cache_params_from_dict
from recshard.planner.profile import CalibrationProfile
from recshard.types import BoundsCheckMode, CacheParams

GIB = 1024**3
_GBPS_TO_BYTES_PER_MS = 1e9 / 1e3
# the intra-host shared-memory transport's default byte cap per rank (`recshard.comm`)
INTRA_HOST_TRANSPORT_BYTES = 64 * 1024**2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value: Any, positive: bool) -> bool:
    """A finite real number, > 0 (`positive`) or >= 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value > 0 if positive else value >= 0


ALL_SHARDING_TYPES = sharding_type_values(sharding_types.ALL_SHARDING_TYPES)  # strings, enum order
ROW_BLOCK_TYPES = frozenset(sharding_type_values(sharding_types.ROW_BLOCK_TYPES))  # strings
UVM_KERNELS = ("fused_uvm", "fused_uvm_caching")


class PlannerError(RuntimeError):
    """No plan fits, or the planner's input is inconsistent. The message says which table,
    how much memory it needs per compute kernel, and which capacity fell short."""


# Defaults per compute device: (hbm_cap, ddr_cap, hbm_bw, ddr_bw, hbm_to_ddr_bw, intra, inter)
_DEFAULTS: Dict[str, Tuple[float, float, float, float, float, float, float]] = {
    "cpu": (0, 128 * GIB, 0.0, 51.0, 0.0, 10.0, 3.0),
    "cuda": (32 * GIB, 128 * GIB, 897.0, 51.0, 32.0, 600.0, 12.5),
}


_STORAGE_GBPS = 1.0  # scattered row reads and write-backs on a local NVMe disk


class Topology:
    """The ranks a plan is for: how many, grouped in hosts, with memory and bandwidths per rank.

    Defaults for `compute_device="cpu"`: no HBM, 128 GiB DDR per rank, DDR bandwidth 51 GB/s,
    10 GB/s between ranks of a host (gloo over shared memory / loopback), 3 GB/s between hosts
    (25 GbE). For `"cuda"`: 32 GiB HBM and 128 GiB DDR per rank, HBM 897 GB/s, DDR 51 GB/s,
    host<->device 32 GB/s (PCIe 4), NVLink 600 GB/s inside a host, 12.5 GB/s per rank between
    hosts (100 Gb/s NIC). Capacities are bytes; bandwidths GB/s. `local_world_size` (ranks per
    host, default: all ranks on one host) must divide `world_size`; ranks are host-major.
    `uvm_efficiency` scales host<->device bandwidth for random row reads from UVM memory.
    `profile` (from `recshard-plan calibrate`): measured kernel costs, and link bandwidths
    used for `intra_host_bw` / `inter_host_bw` where those are not given.
    `storage_cap`: bytes of local storage (SSD) per rank for `key_value` tables' files (default
    0: none, and the planner offers `key_value` only where constraints name it);
    `storage_bw`: GB/s at which a rank reads and writes scattered rows there (default: the
    profile's measured rate, `calibrate --storage DIR`, else 1.0).
    `ddr_cap` is each rank's DRAM budget: a table whose shards do not fit it is planned
    `key_value` on cpu when there is storage, never into memory it does not have.
    `intra_host_transport_bytes`: what the shared-memory transport among a host's ranks
    (cpu) keeps resident per rank at most, its byte cap (default 64 MiB); 0 when the job runs
    without it. Held on every rank of a host with two or more ranks.
    """

    def __init__(
        self,
        world_size: int,
        compute_device: str = "cpu",
        hbm_cap: float | None = None,
        ddr_cap: float | None = None,
        local_world_size: int | None = None,
        hbm_mem_bw: float | None = None,
        ddr_mem_bw: float | None = None,
        hbm_to_ddr_mem_bw: float | None = None,
        intra_host_bw: float | None = None,
        inter_host_bw: float | None = None,
        uvm_efficiency: float = 0.1,
        profile: CalibrationProfile | None = None,
        intra_host_transport_bytes: int = INTRA_HOST_TRANSPORT_BYTES,
        storage_cap: float | None = None,
        storage_bw: float | None = None,
    ) -> None:
        if compute_device not in _DEFAULTS:
            raise ValueError(f"compute_device must be 'cpu' or 'cuda', got {compute_device!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        local_world_size = world_size if local_world_size is None else local_world_size
        if local_world_size < 1 or world_size % local_world_size != 0:
            raise ValueError(
                f"local_world_size {local_world_size} must divide world_size {world_size}"
            )
        for what, value, positive in (
            ("hbm_cap", hbm_cap, False),
            ("ddr_cap", ddr_cap, False),
            ("hbm_mem_bw", hbm_mem_bw, True),
            ("ddr_mem_bw", ddr_mem_bw, True),
            ("hbm_to_ddr_mem_bw", hbm_to_ddr_mem_bw, True),
            ("intra_host_bw", intra_host_bw, True),
            ("inter_host_bw", inter_host_bw, True),
            ("storage_cap", storage_cap, False),
            ("storage_bw", storage_bw, True),
        ):
            if value is not None and not _in_range(value, positive):
                bound = "> 0" if positive else ">= 0"
                raise ValueError(f"{what} must be a finite number {bound}, got {value!r}")
        if not (_in_range(uvm_efficiency, True) and uvm_efficiency <= 1):
            raise ValueError(f"uvm_efficiency must be in (0, 1], got {uvm_efficiency!r}")
        d_hbm, d_ddr, d_hbm_bw, d_ddr_bw, d_h2d, d_intra, d_inter = _DEFAULTS[compute_device]
        d_storage = _STORAGE_GBPS
        if profile is not None and profile.storage is not None:
            d_storage = profile.storage.gbps
        if profile is not None:
            d_intra = profile.gbps("intra") or d_intra
            d_inter = profile.gbps("inter") or d_inter
        self.profile = profile
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.compute_device = compute_device
        self.hbm_cap = float(d_hbm if hbm_cap is None else hbm_cap)
        self.ddr_cap = float(d_ddr if ddr_cap is None else ddr_cap)
        if compute_device == "cpu" and self.hbm_cap:
            raise ValueError("a cpu topology has no HBM; set ddr_cap instead of hbm_cap")
        gb = _GBPS_TO_BYTES_PER_MS
        self.hbm_mem_bw = (d_hbm_bw if hbm_mem_bw is None else hbm_mem_bw) * gb
        self.ddr_mem_bw = (d_ddr_bw if ddr_mem_bw is None else ddr_mem_bw) * gb
        self.hbm_to_ddr_mem_bw = (d_h2d if hbm_to_ddr_mem_bw is None else hbm_to_ddr_mem_bw) * gb
        self.intra_host_bw = (d_intra if intra_host_bw is None else intra_host_bw) * gb
        self.inter_host_bw = (d_inter if inter_host_bw is None else inter_host_bw) * gb
        self.uvm_efficiency = uvm_efficiency
        self.storage_cap = float(storage_cap or 0.0)
        self.storage_bw = (d_storage if storage_bw is None else storage_bw) * gb
        if not _is_int(intra_host_transport_bytes) or intra_host_transport_bytes < 0:
            raise ValueError(
                "intra_host_transport_bytes must be an integer >= 0, got "
                f"{intra_host_transport_bytes!r}"
            )
        self.intra_host_transport_bytes = intra_host_transport_bytes

    @property
    def transport_bytes_per_rank(self) -> float:
        """Bytes the intra-host shared-memory transport holds on each rank: its cap on cpu
        when two or more ranks share a host, else 0."""
        if self.compute_device != "cpu" or self.local_world_size < 2:
            return 0.0
        return float(self.intra_host_transport_bytes)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def __repr__(self) -> str:
        return (
            f"Topology(world_size={self.world_size}, local_world_size={self.local_world_size}, "
            f"compute_device={self.compute_device!r}, hbm_cap={self.hbm_cap / GIB:.1f}GiB, "
            f"ddr_cap={self.ddr_cap / GIB:.1f}GiB, storage_cap={self.storage_cap / GIB:.1f}GiB)"
        )


@dataclass
class ParameterConstraints:
    """What the user allows or knows about one table (keyed by table name, or
    `"<module fqn>.<table>"`).

    `sharding_types` / `compute_kernels` narrow what the sharder allows. `min_partition` is
    the narrowest column shard for column-wise types (default 64). `pooling_factors`,
    `num_poolings` and `batch_sizes` are per feature (ids per bag, bags per sample, samples
    per rank). `enforce_hbm` drops the UVM kernels. `cache_params` (a `CacheParams`; a dict
    of its fields is converted) and `bounds_check_mode` are carried into the plan;
    `cache_params.load_factor` sizes a UVM cache, and `cache_params.stats` (a
    `CacheStatistics` measured on the user's data) tells the estimators how many distinct
    rows a batch touches and how cacheable they are. `stochastic_rounding` is accepted for
    TorchRec compatibility but `ParameterSharding` has no field for it yet.
    """

    sharding_types: List[str] | None = None
    compute_kernels: List[str] | None = None
    min_partition: int | None = None
    pooling_factors: List[float] | None = None
    num_poolings: List[float] | None = None
    batch_sizes: List[int] | None = None
    is_weighted: bool | None = None
    cache_params: CacheParams | None = None
    enforce_hbm: bool | None = None
    stochastic_rounding: bool | None = None
    bounds_check_mode: BoundsCheckMode | None = None
    feature_names: List[str] | None = None

    def __post_init__(self) -> None:
        for name in ("sharding_types", "compute_kernels"):
            values = getattr(self, name)
            if values is not None:  # accept enums as well as their string values
                setattr(self, name, [getattr(v, "value", v) for v in values])
        if self.sharding_types is not None:
            bad = [s for s in self.sharding_types if s not in ALL_SHARDING_TYPES]
            if bad:
                raise ValueError(f"unknown sharding types {bad}; expected {ALL_SHARDING_TYPES}")
        if self.min_partition is not None and self.min_partition < 1:
            raise ValueError(f"min_partition must be >= 1, got {self.min_partition}")
        if isinstance(self.cache_params, dict):
            self.cache_params = cache_params_from_dict(self.cache_params)
        elif self.cache_params is not None and not isinstance(self.cache_params, CacheParams):
            raise ValueError(
                "cache_params must be a CacheParams (or a dict of its fields), "
                f"got {type(self.cache_params).__name__}"
            )


@dataclass
class TableMeta:
    """Everything the planner needs to know about one table; no tensors, no module.

    `sharding_types` / `compute_kernels` (per sharding type) are what the sharder supports
    (None: every type, the device's default kernels). `optimizer` is the fused optimizer name
    (fbgemm `EmbOptimType` value, e.g. "exact_row_wise_adagrad"; None: exact SGD, no state).
    Per-feature lists default to pooling factor 1, one pooling, the planner's batch size.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: List[str] = field(default_factory=list)
    pooling_factors: List[float] | None = None
    num_poolings: List[float] | None = None
    batch_sizes: List[int] | None = None
    data_type: DataType = DataType.FP32
    is_weighted: bool = False
    pooled: bool = True
    module_fqn: str = ""
    sharding_types: List[str] | None = None
    compute_kernels: Dict[str, List[str]] | None = None
    optimizer: str | None = None

    def __post_init__(self) -> None:
        if self.num_embeddings < 1 or self.embedding_dim < 1:
            raise ValueError(
                f"table '{self.name}': needs num_embeddings >= 1 and embedding_dim >= 1, got "
                f"{self.num_embeddings} x {self.embedding_dim}"
            )
        if isinstance(self.data_type, str):
            self.data_type = DataType(self.data_type.upper())
        if not self.feature_names:
            self.feature_names = [self.name]
        n = len(self.feature_names)
        for name in ("pooling_factors", "num_poolings", "batch_sizes"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(
                    f"table '{self.name}': {name} has {len(values)} values for {n} features "
                    f"{self.feature_names}"
                )
        if self.optimizer is not None:
            self.optimizer = normalize_optimizer(self.optimizer)

    @property
    def key(self) -> str:
        """`<module fqn>.<table>` (or the table name for a root-level module)."""
        return f"{self.module_fqn}.{self.name}" if self.module_fqn else self.name


def normalize_optimizer(optimizer: Any) -> str:
    """An optimizer name from an fbgemm `EmbOptimType`, its name or value ("ADAM", "adam")."""
    value = getattr(optimizer, "value", optimizer)
    return str(value).lower()


@dataclass(slots=True)
class Perf:
    """Estimated time of one shard per training step, in ms."""

    fwd_compute: float = 0.0
    fwd_comms: float = 0.0
    bwd_compute: float = 0.0
    bwd_comms: float = 0.0
    input_dist: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.fwd_compute + self.fwd_comms + self.bwd_compute + self.bwd_comms + self.input_dist
        )


@dataclass(slots=True)
class Storage:
    """Bytes one shard needs in device memory (HBM), host memory (DDR) and local storage
    (`storage`: the files of `key_value` tables)."""

    hbm: float = 0.0
    ddr: float = 0.0
    storage: float = 0.0


@dataclass(slots=True)
class Shard:
    """One shard of a table: `size`/`offset` as [rows, cols], its cost, and its rank once placed."""

    size: List[int]
    offset: List[int]
    perf: Perf
    storage: Storage
    rank: int | None = None


@dataclass(slots=True)
class Segment:
    """A run of `count` consecutive shards of the same size and cost (a row-wise table over
    1,024 ranks is at most three segments: full blocks, one partial block, empty shards)."""

    count: int
    rows: int
    cols: int
    perf: Perf
    storage: Storage
    perf_total: float = 0.0


_PARTITION_BY = {
    "table_wise": "device",
    "column_wise": "device",
    "table_row_wise": "host",
    "table_column_wise": "host",
    "row_wise": "uniform",
    "data_parallel": "uniform",
}


class ShardingOption:
    """One candidate for one table: a sharding type, a compute kernel and its shards.

    Shards are kept as `segments` (runs of equal shards) so a row-wise option over 1,024 ranks
    costs three objects, not 1,024; `shards` expands them. `partition_by` says how shards are
    placed: "device" (each shard on any rank), "host" (all shards inside one host) or
    "uniform" (shard i on rank i, data-parallel replicas on every rank). `ranks` is set only on
    the placed copies that the planner returns.
    """

    __slots__ = (
        "table",
        "sharding_type",
        "compute_kernel",
        "partition_by",
        "segments",
        "num_shards",
        "total_perf",
        "max_perf",
        "total_hbm",
        "total_ddr",
        "max_hbm",
        "max_ddr",
        "cache_params",
        "bounds_check_mode",
        "ranks",
        "costs",
    )

    def __init__(
        self,
        table: TableMeta,
        sharding_type: str,
        compute_kernel: str,
        segments: List[Segment],
        cache_params: CacheParams | None = None,
        bounds_check_mode: BoundsCheckMode | None = None,
    ) -> None:
        self.table = table
        self.sharding_type = sharding_type
        self.compute_kernel = compute_kernel
        self.partition_by = _PARTITION_BY[sharding_type]
        self.segments = segments
        self.cache_params = cache_params
        self.bounds_check_mode = bounds_check_mode
        self.ranks: List[int] | None = None
        num = 0
        total_perf = total_hbm = total_ddr = max_perf = max_hbm = max_ddr = 0.0
        for seg in segments:
            p = seg.perf_total = seg.perf.total
            h, d, n = seg.storage.hbm, seg.storage.ddr, seg.count
            num += n
            total_perf += n * p
            total_hbm += n * h
            total_ddr += n * d
            max_perf, max_hbm, max_ddr = max(max_perf, p), max(max_hbm, h), max(max_ddr, d)
        self.num_shards = num
        self.total_perf, self.total_hbm, self.total_ddr = total_perf, total_hbm, total_ddr
        self.max_perf, self.max_hbm, self.max_ddr = max_perf, max_hbm, max_ddr
        # per-shard (perf, hbm, ddr) for the options placed shard by shard
        self.costs = self.shard_costs() if self.partition_by != "uniform" else None

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def module_fqn(self) -> str:
        return self.table.module_fqn

    @property
    def max_storage(self) -> float:
        """Bytes the largest shard keeps on local storage (`key_value` files; else 0)."""
        return max((seg.storage.storage for seg in self.segments), default=0.0)

    def shard_costs(self) -> List[Tuple[float, float, float]]:
        """(perf total, hbm, ddr) of every shard, in shard order."""
        out: List[Tuple[float, float, float]] = []
        for s in self.segments:
            out.extend([(s.perf_total, s.storage.hbm, s.storage.ddr)] * s.count)
        return out

    @property
    def shards(self) -> List[Shard]:
        """Every shard with its size, offset, cost and (once placed) rank. Data-parallel
        options list one full-table replica per rank."""
        row_wise = self.sharding_type in ROW_BLOCK_TYPES
        shards: List[Shard] = []
        row_off = col_off = 0
        for s in self.segments:
            for _ in range(s.count):
                rank = self.ranks[len(shards)] if self.ranks is not None else None
                shards.append(Shard([s.rows, s.cols], [row_off, col_off], s.perf, s.storage, rank))
                if row_wise:
                    row_off += s.rows
                elif self.sharding_type != "data_parallel":
                    col_off += s.cols
        return shards

    def placed(self, ranks: List[int]) -> ShardingOption:
        """A copy of this option with its shards on `ranks` (cheap: segments are shared)."""
        copy = ShardingOption.__new__(ShardingOption)
        for slot in ShardingOption.__slots__:
            setattr(copy, slot, getattr(self, slot))
        copy.ranks = ranks
        return copy

    def __repr__(self) -> str:
        return (
            f"ShardingOption({self.table.key}, {self.sharding_type}, {self.compute_kernel}, "
            f"shards={self.num_shards}, perf={self.total_perf:.3f}ms, "
            f"hbm={self.total_hbm / GIB:.3f}GiB, ddr={self.total_ddr / GIB:.3f}GiB)"
        )
