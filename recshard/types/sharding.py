"""What a sharding plan is made of and where it runs: sharding types, compute kernels, cache
parameters, `ParameterSharding`, `ShardingPlan` and `ShardingEnv` (TorchRec's names)."""

from __future__ import annotations

import abc
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec


class ShardingType(enum.Enum):
    """How one table is split over ranks."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"


class EmbeddingComputeKernel(enum.Enum):
    """How a shard's lookup runs: `fused` (TBE with the optimizer in backward), `dense`
    (autograd weights for any torch optimizer), UVM variants on CUDA, `quant` for inference,
    `key_value` (fused, rows on local storage behind a bounded DRAM cache; CPU)."""

    DENSE = "dense"
    FUSED = "fused"
    FUSED_UVM = "fused_uvm"
    FUSED_UVM_CACHING = "fused_uvm_caching"
    QUANT = "quant"
    KEY_VALUE = "key_value"


class ComputeKernel(enum.Enum):
    """TorchRec's base vocabulary of kernels: only the default (EmbeddingComputeKernel names
    the embedding ones)."""

    DEFAULT = "default"


class ParameterStorage(enum.Enum):
    """Where a shard's bytes live, as planner constraints name it: device memory (HBM) or host
    memory (DDR)."""

    HBM = "hbm"
    DDR = "ddr"


class BoundsCheckMode(enum.Enum):
    """What to do with ids outside [0, num_embeddings): raise (default), warn and drop, drop,
    or skip the check entirely."""

    FATAL = "fatal"
    WARNING = "warning"
    IGNORE = "ignore"
    NONE = "none"


# A data-parallel table whose fp32 gradient is smaller than this skips the exchange of the rows
# in use (its extra collective costs more than the bytes it saves) and shares one all-reduce
# per lookup kernel (`recshard.sharding.data_parallel`; the planner prices it the same way).
ROW_EXCHANGE_MIN_BYTES = 4 << 20


class PipelineType(enum.Enum):
    """The training pipeline a plan is for (TorchRec's names): how many batches of ids a
    rank holds at once, which the planner's memory estimate counts (`INPUT_COPIES` in
    `recshard.planner.cost.estimators`)."""

    NONE = "none"
    TRAIN_BASE = "train_base"
    TRAIN_SPARSE_DIST = "train_sparse_dist"
    TRAIN_PREFETCH_SPARSE_DIST = "train_prefetch_sparse_dist"


class CacheAlgorithm(enum.Enum):
    """Eviction policy of a UVM cache (fbgemm's names and values, as TorchRec re-exports)."""

    LRU = 0
    LFU = 1


class CacheStatistics(abc.ABC):
    """What the user knows about a table's ids, for the planner (TorchRec's contract).

    `expected_lookups`: the expected number of distinct rows looked up in a global training
    batch (all ranks' samples). `expected_miss_rate(clf)`: the miss rate of a cache holding
    `clf` of the table's rows (1.0 at clf 0, 0.0 at clf 1). `cacheability`: a size-independent
    score, 0 very cacheable to 1 hard to cache."""

    @property
    @abc.abstractmethod
    def expected_lookups(self) -> float:
        """Expected distinct rows looked up per global training batch."""

    @abc.abstractmethod
    def expected_miss_rate(self, clf: float) -> float:
        """Expected miss rate of a cache of load factor `clf`."""

    @property
    @abc.abstractmethod
    def cacheability(self) -> float:
        """0 (easy to cache) to 1 (hard), whatever the cache size."""


@dataclass
class CacheParams:
    """Cache settings and data statistics of one table (TorchRec's fields). The planner uses
    `load_factor` (share of rows a UVM cache holds) and `stats` (`CacheStatistics`: how many
    distinct rows a batch touches, how cacheable they are); the other fields are carried in
    the plan. `precision` is a `recshard.DataType` (typed `Any` here: this module sits below
    `recshard.modules`). The hash leaves `stats` out, as TorchRec's does."""

    algorithm: CacheAlgorithm | None = None
    load_factor: float | None = None
    reserved_memory: float | None = None
    precision: Any | None = None
    prefetch_pipeline: bool | None = None
    stats: CacheStatistics | None = None
    multipass_prefetch_config: Any | None = None

    def __hash__(self) -> int:
        return hash(
            (
                self.algorithm,
                self.load_factor,
                self.reserved_memory,
                self.precision,
                self.prefetch_pipeline,
                self.multipass_prefetch_config,
            )
        )


@dataclass
class ShardMetadata:
    """One shard of a table: where it starts, how big it is, and which rank holds it."""

    shard_offsets: List[int]
    shard_sizes: List[int]
    placement: str  # "rank:<r>/<device>"

    @property
    def rank(self) -> int:
        return int(self.placement.split("/")[0].split(":")[1])


@dataclass
class ParameterSharding:
    """How one table is sharded: its type, kernel, ranks and per-shard geometry.

    `shards` lists every shard in the global table (rows x cols offsets and sizes); for
    data-parallel tables it is None (every rank holds the whole table).
    """

    sharding_type: str
    compute_kernel: str
    ranks: List[int] | None = None
    shards: List[ShardMetadata] | None = None
    bounds_check_mode: BoundsCheckMode | None = None
    cache_params: CacheParams | None = None

    @property
    def sharding_spec(self) -> EnumerableShardingSpec | None:
        """The shards as torch's `EnumerableShardingSpec` (as TorchRec fills its field);
        None for data-parallel tables."""
        if self.shards is None:
            return None
        return EnumerableShardingSpec(
            [
                TorchShardMetadata(list(s.shard_offsets), list(s.shard_sizes), s.placement)
                for s in self.shards
            ]
        )


EmbeddingModuleShardingPlan = Dict[str, ParameterSharding]


@dataclass
class ShardingPlan:
    """Per module path (FQN in the model), the per-table `ParameterSharding`s."""

    plan: Dict[str, EmbeddingModuleShardingPlan] = field(default_factory=dict)

    def get_plan_for_module(self, module_path: str) -> EmbeddingModuleShardingPlan | None:
        return self.plan.get(module_path)

    def __str__(self) -> str:
        lines = ["module | table | sharding type | compute kernel | ranks"]
        for module_path, tables in self.plan.items():
            for table, ps in tables.items():
                lines.append(
                    f"{module_path or '<root>'} | {table} | {ps.sharding_type} | "
                    f"{ps.compute_kernel} | {ps.ranks}"
                )
        return "\n".join(lines)


def get_local_size(world_size: int | None = None) -> int:
    """Ranks per node: torchrun's LOCAL_WORLD_SIZE, else the whole world (one node)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if world_size is not None:
        return world_size
    return dist.get_world_size() if dist.is_initialized() else 1


class ShardingEnv:
    """The process group a sharded module runs on, with its world size and rank.

    `local_world_size` is the number of ranks per node (table-row-wise sharding splits rows
    within a node); it defaults to the torchrun `LOCAL_WORLD_SIZE`, else the world size.
    """

    def __init__(
        self,
        world_size: int,
        rank: int,
        pg: dist.ProcessGroup | None = None,
        local_world_size: int | None = None,
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.pg = pg
        if local_world_size is None:
            local_world_size = get_local_size(world_size)
        if local_world_size < 1 or world_size % local_world_size != 0:
            raise ValueError(
                f"local_world_size {local_world_size} must divide world_size {world_size}"
            )
        self.local_world_size = local_world_size

    @classmethod
    def from_process_group(
        cls, pg: dist.ProcessGroup, local_world_size: int | None = None
    ) -> ShardingEnv:
        return cls(dist.get_world_size(pg), dist.get_rank(pg), pg, local_world_size)

    @classmethod
    def from_local(cls, world_size: int, rank: int) -> ShardingEnv:
        return cls(world_size, rank, None, world_size)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def __deepcopy__(self, memo: Dict[int, Any]) -> ShardingEnv:
        """A copy on the same process group (process groups cannot be copied), so modules
        that keep their env (data-parallel tables) deep-copy as `DistributedModelParallel.copy`
        does."""
        return ShardingEnv(self.world_size, self.rank, self.pg, self.local_world_size)

    def __repr__(self) -> str:
        return (
            f"ShardingEnv(world_size={self.world_size}, rank={self.rank}, "
            f"local_world_size={self.local_world_size})"
        )
