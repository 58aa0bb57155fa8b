"""Check a module's plan before sharding: every error names the table and the bad value."""

from __future__ import annotations

from typing import List, Sequence

from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ShardingEnv,
    ShardingType,
    ShardMetadata,
)

SEQUENCE_TYPES = {ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE,
                  ShardingType.ROW_WISE}


def _covers(table: str, what: str, extent: int, pieces: Sequence[tuple]) -> None:
    """`pieces` = (offset, size) in order must tile [0, extent) exactly."""
    position = 0
    for offset, size in pieces:
        if offset != position:
            raise ValueError(
                f"table '{table}': {what} shards leave a gap or overlap at {position} "
                f"(next shard starts at {offset})"
            )
        position += size
    if position != extent:
        raise ValueError(f"table '{table}': {what} shards cover {position} of {extent}")


def _check_shards(config: BaseEmbeddingConfig, st: ShardingType, shards: List[ShardMetadata],
                  env: ShardingEnv) -> None:
    name, rows, cols = config.name, config.num_embeddings, config.embedding_dim
    for shard in shards:
        if not 0 <= shard.rank < env.world_size:
            raise ValueError(
                f"table '{name}': shard placed on rank {shard.rank}, outside world size {env.world_size}"
            )
    if st == ShardingType.TABLE_WISE and len(shards) != 1:
        raise ValueError(f"table '{name}': table_wise takes exactly one shard, got {len(shards)}")
    if st in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        for shard in shards:
            if shard.shard_offsets[1] != 0 or shard.shard_sizes[1] != cols:
                raise ValueError(f"table '{name}': {st.value} shards must span all {cols} columns")
        _covers(name, "row", rows, [(s.shard_offsets[0], s.shard_sizes[0]) for s in shards])
    else:
        for shard in shards:
            if shard.shard_offsets[0] != 0 or shard.shard_sizes[0] != rows:
                raise ValueError(f"table '{name}': {st.value} shards must span all {rows} rows")
        _covers(name, "column", cols, [(s.shard_offsets[1], s.shard_sizes[1]) for s in shards])
    ranks = [s.rank for s in shards]
    if st == ShardingType.ROW_WISE and ranks != list(range(env.world_size)):
        raise ValueError(f"table '{name}': row_wise shards must sit on ranks 0..{env.world_size - 1} "
                         f"in order, got {ranks}")
    if st in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE):
        nodes = {r // env.local_world_size for r in ranks}
        if len(nodes) != 1:
            raise ValueError(f"table '{name}': {st.value} shards must stay in one node "
                             f"(local_world_size {env.local_world_size}), got ranks {ranks}")
    if st == ShardingType.TABLE_ROW_WISE:
        node = ranks[0] // env.local_world_size
        expected = [node * env.local_world_size + i for i in range(env.local_world_size)]
        if ranks != expected:
            raise ValueError(f"table '{name}': table_row_wise shards must sit on ranks {expected} "
                             f"in order, got {ranks}")


def check_module_plan(
    configs: Sequence[BaseEmbeddingConfig],
    plan: EmbeddingModuleShardingPlan,
    env: ShardingEnv,
    owner: str,
    pooled: bool,
) -> None:
    names = [c.name for c in configs]
    unknown = [t for t in plan if t not in names]
    if unknown:
        raise ValueError(f"{owner}: the plan names tables {unknown} that the module lacks "
                         f"(its tables: {names})")
    missing = [t for t in names if t not in plan]
    if missing:
        raise ValueError(f"{owner}: the plan has no entry for tables {missing}")
    for config in configs:
        ps = plan[config.name]
        try:
            st = ShardingType(ps.sharding_type)
        except ValueError:
            raise ValueError(f"table '{config.name}': unknown sharding type '{ps.sharding_type}' "
                             f"(choose from {[t.value for t in ShardingType]})") from None
        if not pooled and st not in SEQUENCE_TYPES:
            raise ValueError(f"table '{config.name}': {owner} does not support {st.value} "
                             f"(supported: {sorted(t.value for t in SEQUENCE_TYPES)})")
        try:
            EmbeddingComputeKernel(ps.compute_kernel)
        except ValueError:
            raise ValueError(f"table '{config.name}': unknown compute kernel '{ps.compute_kernel}'") from None
        if st == ShardingType.DATA_PARALLEL:
            continue
        if not ps.shards:
            raise ValueError(f"table '{config.name}': {st.value} needs shard metadata "
                             "(build plans with construct_module_sharding_plan or the planner)")
        _check_shards(config, st, ps.shards, env)
