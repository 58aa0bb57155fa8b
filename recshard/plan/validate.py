"""The one plan validator: every rule a plan must meet, written once, each error naming the
table and the bad value (raised before any collective starts, on every rank alike).

Used by the sharded modules when they are built (so by DMP and every sharder, quant ones
included), by the planner on its own output, by `construct_module_sharding_plan`, and by
`load_plan` / `validate_plan` against a model. Rules, per table of a planned module:

- the plan and the module name the same tables; the sharding type and compute kernel are
  known, and the module (its sharder) supports them;
- data-parallel: no shards needed; every other type: shards that tile the table exactly
  (row types: every shard spans all columns, rows in order without gap or overlap; column
  types: the mirror image), table-wise exactly one shard;
- ranks inside the world, `ranks` agreeing with the shards' placements; row-wise shards on
  ranks 0..W-1 in order; table-row-wise and table-column-wise shards inside one node
  (table-row-wise: all of its ranks, in order).
"""

from __future__ import annotations

from typing import Collection, List, Protocol, Sequence, Tuple

from torch import nn

from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.plan.module_tables import embedding_tables, holds_tables
from recshard.plan.sharding_types import (
    ALL_SHARDING_TYPES,
    ROW_SPLIT_TYPES,
    SEQUENCE_SHARDING_TYPES,
    WITHIN_NODE_TYPES,
    sharding_type_values,
)
from recshard.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)


class PlanValidationError(ValueError):
    """A plan does not match the model or the world it is used with; names the table."""


class TableShape(Protocol):
    """What the rules read of a table: an embedding config, or the planner's `TableMeta`."""

    name: str
    num_embeddings: int
    embedding_dim: int


def _value(x: object) -> str:
    return str(getattr(x, "value", x))


def _covers(where: str, what: str, extent: int, pieces: Sequence[Tuple[int, int]]) -> None:
    """`pieces` = (offset, size) in order must tile [0, extent) exactly."""
    position = 0
    for offset, size in pieces:
        if offset != position:
            raise PlanValidationError(
                f"{where}: {what} shards leave a gap or overlap at {position} "
                f"(next shard starts at {offset})"
            )
        position += size
    if position != extent:
        raise PlanValidationError(f"{where}: {what} shards cover {position} of {extent}")


def _check_shards(
    where: str,
    config: TableShape,
    st: ShardingType,
    shards: List[ShardMetadata],
    world_size: int | None,
    local_world_size: int | None,
) -> None:
    rows, cols = config.num_embeddings, config.embedding_dim
    if st == ShardingType.TABLE_WISE and len(shards) != 1:
        raise PlanValidationError(f"{where}: table_wise takes exactly one shard, got {len(shards)}")
    row_split = st in ROW_SPLIT_TYPES
    for shard in shards:
        across, full = (1, cols) if row_split else (0, rows)
        if shard.shard_offsets[across] != 0 or shard.shard_sizes[across] != full:
            raise PlanValidationError(
                f"{where}: {st.value} shards must span all {full} "
                f"{'columns' if row_split else 'rows'}"
            )
    axis = 0 if row_split else 1
    _covers(
        where,
        "row" if row_split else "column",
        rows if row_split else cols,
        [(s.shard_offsets[axis], s.shard_sizes[axis]) for s in shards],
    )
    ranks = [s.rank for s in shards]
    if world_size is not None and st == ShardingType.ROW_WISE and ranks != list(range(world_size)):
        raise PlanValidationError(
            f"{where}: row_wise shards must sit on ranks 0..{world_size - 1} in order, got {ranks}"
        )
    if local_world_size and st in WITHIN_NODE_TYPES:
        hosts = sorted({r // local_world_size for r in ranks})
        if len(hosts) != 1:
            raise PlanValidationError(
                f"{where}: {st.value} shards span hosts {hosts} "
                f"(local_world_size {local_world_size}), ranks {ranks}"
            )
        expected = [hosts[0] * local_world_size + i for i in range(local_world_size)]
        if st == ShardingType.TABLE_ROW_WISE and ranks != expected:
            raise PlanValidationError(
                f"{where}: table_row_wise shards must sit on ranks {expected} in order, got {ranks}"
            )


def check_ranks_agree(where: str, ranks: Sequence[int], shards: Sequence[ShardMetadata]) -> None:
    """A table's `ranks` name exactly the ranks its shards are placed on."""
    placed = sorted({s.rank for s in shards})
    if sorted(set(ranks)) != placed:
        raise PlanValidationError(
            f"{where}: {list(ranks)} do not agree with the shards' placements (ranks {placed})"
        )


def check_table_plan(
    config: TableShape,
    ps: ParameterSharding,
    world_size: int | None = None,
    local_world_size: int | None = None,
    sharding_types: Collection[ShardingType] = ALL_SHARDING_TYPES,
    compute_kernels: Collection[str] | None = None,
    where: str | None = None,
    owner: str = "the module",
) -> None:
    """One table's entry against the table, the world and what its module supports."""
    where = where or f"table '{config.name}'"
    try:
        st = ShardingType(_value(ps.sharding_type))
    except ValueError:
        raise PlanValidationError(
            f"{where}: unknown sharding type '{_value(ps.sharding_type)}' "
            f"(choose from {[t.value for t in ShardingType]})"
        ) from None
    if st not in sharding_types:
        raise PlanValidationError(
            f"{where}: {owner} does not support {st.value} "
            f"(supported: {sorted(sharding_type_values(frozenset(sharding_types)))})"
        )
    kernel = _value(ps.compute_kernel)
    try:
        EmbeddingComputeKernel(kernel)
    except ValueError:
        raise PlanValidationError(f"{where}: unknown compute kernel '{kernel}'") from None
    if compute_kernels is not None and kernel not in compute_kernels:
        allowed = " or ".join(repr(k) for k in sorted(compute_kernels))
        raise PlanValidationError(
            f"{where}: {owner} is sharded with compute_kernel={allowed}, got '{kernel}'"
        )
    ranks = list(ps.ranks or []) + [s.rank for s in ps.shards or []]
    if world_size is not None:
        bad = sorted({r for r in ranks if not 0 <= r < world_size})
        if bad:
            raise PlanValidationError(f"{where}: ranks {bad} are outside world size {world_size}")
    if st == ShardingType.DATA_PARALLEL:
        return
    if not ps.shards:
        raise PlanValidationError(
            f"{where}: {st.value} needs shard metadata "
            "(build plans with construct_module_sharding_plan or the planner)"
        )
    _check_shards(where, config, st, ps.shards, world_size, local_world_size)
    if ps.ranks is not None:
        check_ranks_agree(f"{where}: ranks", ps.ranks, ps.shards)


def check_module_plan(
    configs: Sequence[BaseEmbeddingConfig],
    plan: EmbeddingModuleShardingPlan,
    owner: str,
    world_size: int | None = None,
    local_world_size: int | None = None,
    sharding_types: Collection[ShardingType] = ALL_SHARDING_TYPES,
    compute_kernels: Collection[str] | None = None,
    fqn: str = "",
) -> None:
    """A collection's plan (`{table: ParameterSharding}`) against its tables: each table
    planned once, no unknown table, every entry valid (`check_table_plan`)."""
    names = [c.name for c in configs]
    known = set(names)  # membership by set: linear in the tables, not quadratic
    unknown = [t for t in plan if t not in known]
    if unknown:
        raise PlanValidationError(
            f"{owner}: the plan names tables {unknown} that the module lacks (its tables: {names})"
        )
    missing = [t for t in names if t not in plan]
    if missing:
        raise PlanValidationError(f"{owner}: the plan has no entry for tables {missing}")
    for config in configs:
        check_table_plan(
            config,
            plan[config.name],
            world_size,
            local_world_size,
            sharding_types,
            compute_kernels,
            f"table '{fqn + '.' if fqn else ''}{config.name}'",
            owner,
        )


def validate_plan(
    plan: ShardingPlan,
    module: nn.Module,
    world_size: int | None = None,
    local_world_size: int | None = None,
) -> None:
    """Check that `plan` fits `module` (every planned module exists and each of its plans
    passes `check_module_plan`; sequence collections support their types only). Raises
    PlanValidationError naming the table."""
    modules = dict(module.named_modules())
    for fqn, planned in plan.plan.items():
        found = embedding_tables(modules[fqn]) if fqn in modules else None
        if found is None:
            raise PlanValidationError(
                f"plan names module '{fqn}', which the model does not have; embedding modules: "
                f"{sorted(f for f, m in modules.items() if holds_tables(m))}"
            )
        configs, pooled = found
        check_module_plan(
            configs,
            planned,
            f"module '{fqn}'",
            world_size,
            local_world_size,
            ALL_SHARDING_TYPES if pooled else SEQUENCE_SHARDING_TYPES,
            fqn=fqn,
        )
