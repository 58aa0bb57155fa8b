"""The join of a multi-sharding module's outputs in the planner's per-rank memory estimate
(issue #22, memory target): `module_join_bytes` counts `JOIN_COPIES` `[B, sum of dims]`
buffers for a module whose pooled tables span more than one sharding, none otherwise; two real
ranks keep the join's reorder and its gradient at exactly that size only in the mixed case."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from multiprocess import run_ranks
from planner_cases import shard_on_world

from recshard.comm import buffers
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, TableMeta, Topology
from recshard.planner.cost.plan_stats import JOIN_COPIES, match_plan, module_join_bytes
from recshard.sparse import KeyedJaggedTensor
from recshard.types import ShardingPlan

ROWS, DIM, BATCH, TABLES = 1000, 64, 4096, 3  # a [BATCH, DIM] fp32 output: 1 MiB, kept
WIDTH = TABLES * DIM  # the module's output columns


def _tables(fqn: str = "") -> List[TableMeta]:
    return [
        TableMeta(
            f"t{i}", ROWS, DIM, feature_names=[f"f{i}"], pooling_factors=[2.0], module_fqn=fqn
        )
        for i in range(TABLES)
    ]


def _plan(types: Dict[str, str], tables: List[TableMeta]) -> ShardingPlan:
    constraints = {
        name: ParameterConstraints(
            sharding_types=[st], compute_kernels=["dense" if st == "data_parallel" else "fused"]
        )
        for name, st in types.items()
    }
    return EmbeddingShardingPlanner(
        Topology(2), BATCH, constraints=constraints, debug=False
    ).plan_tables(tables)


MIXED = {"t0": "table_wise", "t1": "data_parallel", "t2": "row_wise"}
PLACED = {"t0": "table_wise", "t1": "column_wise", "t2": "table_wise"}  # one sharding


@pytest.mark.parametrize(
    "types, copies", [(MIXED, JOIN_COPIES), (PLACED, 0)], ids=["mixed", "placed"]
)
def test_join_bytes_count_only_modules_of_several_shardings(types, copies) -> None:
    tables = _tables()
    matched = match_plan(_plan(types, tables), tables, Topology(2))
    assert module_join_bytes(matched, BATCH) == copies * BATCH * WIDTH * 4


def _kept_widths(rank: int, world_size: int, plan: ShardingPlan) -> Dict[str, List[int]]:
    """Train the planned module 2 steps; the sizes (elements) `buffers` keeps per site."""
    module = shard_on_world(plan, ROWS, DIM, TABLES)
    ids = (torch.arange(TABLES * BATCH * 2) * 7919 + rank) % ROWS
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [f"f{i}" for i in range(TABLES)], ids, torch.full((TABLES * BATCH,), 2), stride=BATCH
    )
    buffers.clear()
    for _ in range(2):
        module(kjt).values().sum().backward()
    kept: Dict[str, List[int]] = {}
    for site, numel in buffers.kept():
        kept.setdefault(site, []).append(numel)
    return kept


def test_ranks_keep_the_join_only_for_a_module_of_several_shardings() -> None:
    tables = _tables()
    mixed, placed = (
        run_ranks(2, _kept_widths, _plan(MIXED, tables), timeout=240)[0],
        run_ranks(2, _kept_widths, _plan(PLACED, tables), timeout=240)[0],
    )
    # one sharding: its all-to-all lays out the module's columns itself, and packs their
    # gradient back (the module output copies every sharding's estimate counts)
    assert placed["columns"] == placed["columns_bwd"] == [BATCH * WIDTH]
    # mixed: the table-wise sharding's own [B, DIM] both ways, and on top the key-order
    # reorder of the joined outputs and its gradient, [B, WIDTH] each
    assert sorted(mixed["columns"]) == sorted(mixed["columns_bwd"]) == [BATCH * DIM, BATCH * WIDTH]
