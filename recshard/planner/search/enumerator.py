"""Enumerator: every (sharding type x compute kernel x shard count) a table may use, with the
cost of each shard; plus reading table metadata off a module and its sharders."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

from torch import nn

from recshard.plan.module_tables import embedding_tables
from recshard.planner.cost.estimators import EmbeddingPerfEstimator
from recshard.planner.cost.key_value import KEY_VALUE, offers_key_value
from recshard.planner.cost.storage import EmbeddingStorageEstimator
from recshard.planner.planner_types import (
    ALL_SHARDING_TYPES,
    UVM_KERNELS,
    ParameterConstraints,
    PlannerError,
    Segment,
    ShardingOption,
    TableMeta,
    Topology,
)
from recshard.types import ModuleSharder

DEFAULT_MIN_PARTITION = 64
Runs = List[Tuple[int, int, int]]  # (shard count, rows, cols)


def default_compute_kernels(sharding_type: str, compute_device: str) -> List[str]:
    """What recshard's embedding sharders offer: data-parallel is dense; the rest are fused or
    dense, plus the UVM kernels on cuda."""
    if sharding_type == "data_parallel":
        return ["dense"]
    if compute_device == "cuda":
        return ["fused", "fused_uvm", "fused_uvm_caching", "dense"]
    return ["fused", "dense"]


def row_runs(rows: int, cols: int, num_shards: int) -> Runs:
    """Row-wise shards as runs, matching `recshard.plan.geometry.row_wise_sizes`."""
    block = max(1, -(-rows // num_shards))
    full = min(num_shards, rows // block)
    rest = rows - full * block
    runs: Runs = [(full, block, cols)] if full else []
    if rest and full < num_shards:
        runs.append((1, rest, cols))
    empty = num_shards - sum(r[0] for r in runs)
    if empty:
        runs.append((empty, 0, cols))
    return runs


def column_runs(rows: int, cols: int, num_shards: int) -> Runs:
    """Column-wise shards as runs, matching `recshard.plan.geometry.column_wise_sizes`."""
    base, extra = divmod(cols, num_shards)
    runs: Runs = [(extra, rows, base + 1)] if extra else []
    return runs + [(num_shards - extra, rows, base)]


def column_shard_counts(cols: int, min_partition: int, max_shards: int) -> List[int]:
    """Column shard counts to offer: the most that keeps shards >= min_partition wide (at most
    `max_shards`) and the powers of two below it."""
    most = max(1, min(cols // min_partition, max_shards))
    counts = {most}
    n = 2
    while n < most:
        counts.add(n)
        n *= 2
    return sorted(counts)


def find_constraints(
    constraints: Dict[str, ParameterConstraints] | None, table: TableMeta
) -> ParameterConstraints:
    """The constraints for `table`, by `"<fqn>.<table>"` first, then by table name."""
    if constraints:
        found = constraints.get(table.key) or constraints.get(table.name)
        if found is not None:
            return found
    return ParameterConstraints()


def apply_constraints(table: TableMeta, c: ParameterConstraints) -> TableMeta:
    """`table` with the per-feature workload and weightedness the constraints give."""
    changes: Dict[str, Any] = {}
    order = c.feature_names or table.feature_names
    if set(order) != set(table.feature_names):
        raise PlannerError(
            f"table '{table.key}': constraint feature_names {c.feature_names} do not match the "
            f"table's features {table.feature_names}"
        )
    for name in ("pooling_factors", "num_poolings", "batch_sizes"):
        values = getattr(c, name)
        if values is None:
            continue
        if len(values) != len(order):
            raise PlannerError(
                f"table '{table.key}': constraint {name} has {len(values)} values for "
                f"{len(order)} features {order}"
            )
        by_feature = dict(zip(order, values))
        changes[name] = [by_feature[f] for f in table.feature_names]
    if c.is_weighted is not None:
        changes["is_weighted"] = c.is_weighted
    return dataclasses.replace(table, **changes) if changes else table


class EmbeddingEnumerator:
    """Builds the search space: for each table, every sharding type the sharder allows and the
    constraints admit, times each allowed compute kernel, times the column shard counts from
    `min_partition`; each option carries per-shard Perf and Storage from the estimators.

    Pruned as equivalent or dominated: table-row-wise / table-column-wise on one host (same as
    row-wise / column-wise), a one-shard column-wise option when table-wise is allowed, and the
    dense kernel when fused is allowed (unless the constraints name it).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = 512,
        constraints: Dict[str, ParameterConstraints] | None = None,
        perf_estimator: EmbeddingPerfEstimator | None = None,
        storage_estimator: EmbeddingStorageEstimator | None = None,
    ) -> None:
        self.topology = topology
        self.batch_size = batch_size
        self.constraints = constraints
        self.perf_estimator = perf_estimator or EmbeddingPerfEstimator(topology, batch_size)
        self.storage_estimator = storage_estimator or EmbeddingStorageEstimator(
            topology, batch_size
        )

    def enumerate(
        self, module: nn.Module, sharders: Sequence[ModuleSharder]
    ) -> List[List[ShardingOption]]:
        """Options for every table of every shardable submodule of `module`."""
        tables, _ = tables_from_module(module, sharders, self.topology.compute_device)
        return self.enumerate_tables(tables)

    def enumerate_tables(self, tables: Sequence[TableMeta]) -> List[List[ShardingOption]]:
        """Options per table, in table order (PlannerError if a table has none)."""
        seen: Dict[str, int] = {}
        for table in tables:
            if table.key in seen:
                raise PlannerError(f"table '{table.key}' appears twice in the planner input")
            seen[table.key] = 1
        return [self._table_options(table) for table in tables]

    def _table_options(self, raw: TableMeta) -> List[ShardingOption]:
        topo = self.topology
        c = find_constraints(self.constraints, raw)
        table = apply_constraints(raw, c)
        allowed = list(table.sharding_types or ALL_SHARDING_TYPES)
        if c.sharding_types is not None:
            allowed = [st for st in allowed if st in c.sharding_types]
        one_host = topo.num_hosts == 1
        min_partition = c.min_partition or DEFAULT_MIN_PARTITION
        cache: Dict[Tuple[str, str, int, int], Tuple[Any, Any]] = {}
        options: List[ShardingOption] = []
        for st in allowed:
            if one_host and st == "table_row_wise" and "row_wise" in allowed:
                continue
            if one_host and st == "table_column_wise" and "column_wise" in allowed:
                continue
            geometries = self._geometries(table, st, min_partition, "table_wise" in allowed)
            for kernel in self._kernels(table, c, st, allowed):
                for runs in geometries:
                    segments = []
                    for count, rows, cols in runs:
                        key = (st, kernel, rows, cols)
                        if key not in cache:
                            cache[key] = (
                                self.perf_estimator.estimate(
                                    table, st, kernel, rows, cols, c.cache_params
                                ),
                                self.storage_estimator.estimate(
                                    table, st, kernel, rows, cols, c.cache_params
                                ),
                            )
                        perf, storage = cache[key]
                        segments.append(Segment(count, rows, cols, perf, storage))
                    options.append(
                        ShardingOption(
                            table, st, kernel, segments, c.cache_params, c.bounds_check_mode
                        )
                    )
        if not options:
            raise PlannerError(
                f"table '{table.key}': no sharding type / compute kernel combination left. "
                f"Sharder allows {table.sharding_types or ALL_SHARDING_TYPES} with kernels "
                f"{table.compute_kernels or 'default'}; constraints allow sharding_types="
                f"{c.sharding_types}, compute_kernels={c.compute_kernels}, "
                f"enforce_hbm={c.enforce_hbm} on compute device '{topo.compute_device}'"
            )
        return options

    def _kernels(
        self, table: TableMeta, c: ParameterConstraints, st: str, allowed: List[str]
    ) -> List[str]:
        device = self.topology.compute_device
        if table.compute_kernels is not None:
            kernels = list(table.compute_kernels.get(st, []))
        else:
            kernels = default_compute_kernels(st, device)
        named = c.compute_kernels is not None and KEY_VALUE in c.compute_kernels
        if KEY_VALUE not in kernels and offers_key_value(self.topology, st, kernels, named):
            kernels.append(KEY_VALUE)
        if c.compute_kernels is not None:
            kernels = [k for k in kernels if k in c.compute_kernels]
        if device != "cuda" or c.enforce_hbm:
            kernels = [k for k in kernels if k not in UVM_KERNELS]
        if (
            "fused" in kernels
            and "dense" in kernels
            and not (c.compute_kernels and "dense" in c.compute_kernels)
        ):
            kernels.remove("dense")
        if st != "data_parallel" and "data_parallel" in allowed and "dense" in kernels:
            # as TorchRec: a dense table is data-parallel; a model-parallel dense table only
            # when the constraints rule data-parallel out (TorchRec has no such option)
            kernels.remove("dense")
        return kernels

    def _geometries(
        self, table: TableMeta, st: str, min_partition: int, table_wise_allowed: bool
    ) -> List[Runs]:
        rows, cols = table.num_embeddings, table.embedding_dim
        world, local = self.topology.world_size, self.topology.local_world_size
        if st == "table_wise":
            return [[(1, rows, cols)]]
        if st == "data_parallel":
            return [[(world, rows, cols)]]
        if st == "row_wise":
            return [row_runs(rows, cols, world)]
        if st == "table_row_wise":
            return [row_runs(rows, cols, local)]
        cap = world if st == "column_wise" else local
        counts = column_shard_counts(cols, min_partition, cap)
        if table_wise_allowed:
            counts = [n for n in counts if n > 1]
        return [column_runs(rows, cols, n) for n in counts]


def _optimizer_of(sharder: ModuleSharder) -> Any:
    return (sharder.fused_params or {}).get("optimizer")


def tables_from_module(
    module: nn.Module, sharders: Sequence[ModuleSharder], compute_device: str
) -> Tuple[List[TableMeta], float]:
    """Table metadata of every submodule some sharder handles, and the bytes of all other
    parameters (the dense model). Works on `device="meta"` modules."""
    by_type = {sharder.module_type: sharder for sharder in sharders}
    tables: List[TableMeta] = []
    sharded_params: set = set()
    stack: List[Tuple[str, nn.Module]] = [("", module)]
    while stack:
        fqn, mod = stack.pop()
        sharder = by_type.get(type(mod))
        if sharder is None:
            children = list(mod.named_children())
            stack.extend((f"{fqn}.{n}" if fqn else n, c) for n, c in reversed(children))
            continue
        sharded_params.update(id(p) for p in mod.parameters())
        tables.extend(_module_tables(fqn, mod, sharder, compute_device))
    dense_bytes = float(
        sum(
            p.numel() * p.element_size() for p in module.parameters() if id(p) not in sharded_params
        )
    )
    return tables, dense_bytes


def _module_tables(
    fqn: str, mod: nn.Module, sharder: ModuleSharder, compute_device: str
) -> List[TableMeta]:
    found = embedding_tables(mod)
    if found is None:
        raise PlannerError(f"module '{fqn}' ({type(mod).__name__}) holds no embedding tables")
    configs, pooled = found
    by_name = {cfg.name: cfg for cfg in configs}
    weighted = bool(mod.is_weighted()) if hasattr(mod, "is_weighted") else False
    types = [getattr(t, "value", t) for t in sharder.sharding_types(compute_device)]
    kernels = {
        st: [getattr(k, "value", k) for k in sharder.compute_kernels(st, compute_device)]
        for st in types
    }
    optimizer = _optimizer_of(sharder)
    tables = []
    for name in sharder.shardable_parameters(mod):
        cfg = by_name.get(name)
        if cfg is None:
            raise PlannerError(f"module '{fqn}': shardable parameter '{name}' has no table config")
        tables.append(
            TableMeta(
                name=name,
                num_embeddings=cfg.num_embeddings,
                embedding_dim=cfg.embedding_dim,
                feature_names=list(cfg.feature_names),
                data_type=cfg.data_type,
                is_weighted=weighted,
                pooled=pooled,
                module_fqn=fqn,
                sharding_types=types,
                compute_kernels=kernels,
                optimizer=None
                if optimizer is None
                else str(getattr(optimizer, "value", optimizer)),
            )
        )
    return tables
