"""`plan_stats`: per-rank bytes stored / read / sent / received and lookups for any plan
(hand-written, JSON, the planner's own), checked against hand-computed figures."""

from __future__ import annotations

import json

import pytest

from recshard.plan.geometry import make_shards
from recshard.planner import EmbeddingShardingPlanner, TableMeta, Topology, save_plan
from recshard.planner.cost.estimators import wire_id_bytes
from recshard.planner.cost.plan_stats import plan_stats
from recshard.planner.report.cli import main
from recshard.types import ParameterSharding, ShardingPlan

ROWS, DIM, POOLING, BATCH = 1000, 16, 2, 4
IDS, BAGS = POOLING * BATCH, BATCH  # per rank per step
WIRE_ID = 2  # bytes: ids of a 1000-row table (or 500-row block) travel as uint16


def _plan(sharding_type: str, ranks) -> ShardingPlan:
    shards = (
        None
        if sharding_type == "data_parallel"
        else make_shards(sharding_type, ROWS, DIM, ranks, "cpu")
    )
    return ShardingPlan(
        {
            "": {
                "t": ParameterSharding(
                    sharding_type, "fused" if shards else "dense", list(ranks), shards
                )
            }
        }
    )


def _stats(plan: ShardingPlan, world: int = 2, local=None):
    table = TableMeta("t", ROWS, DIM, pooling_factors=[float(POOLING)])
    return plan_stats(plan, [table], Topology(world, local_world_size=local), BATCH)


def test_table_wise_by_hand():
    stats = _stats(_plan("table_wise", [1]))
    r0, r1 = stats.ranks
    assert (r0.bytes_stored, r1.bytes_stored) == (0.0, ROWS * DIM * 4)
    assert (r0.lookups, r1.lookups) == (0.0, 2 * IDS)  # both ranks' ids end up on rank 1
    assert r1.bytes_read == 2 * IDS * DIM * 4
    ids_bytes, pooled = IDS * WIRE_ID, BAGS * DIM * 4
    # rank 0 sends its ids and, backward, its output gradient; gets its pooled rows forward
    assert (r0.bytes_sent, r0.bytes_received) == (ids_bytes + pooled, pooled)
    assert (r1.bytes_sent, r1.bytes_received) == (pooled, ids_bytes + pooled)
    assert stats.max("bytes_stored") == ROWS * DIM * 4 and stats.mean("lookups") == IDS
    assert stats.predicted_step_ms == pytest.approx(stats.max("total_ms")) and r1.total_ms > 0


def test_row_wise_and_data_parallel_by_hand():
    rw = _stats(_plan("row_wise", [0, 1]))
    ring = 2 * (1 / 2) * (2 * BAGS * DIM * 4)  # RS forward + AG backward of [W B, D]
    for r in rw.ranks:
        assert r.bytes_stored == ROWS // 2 * DIM * 4 and r.lookups == IDS
        assert r.bytes_sent == r.bytes_received == IDS / 2 * WIRE_ID + ring
    dp = _stats(_plan("data_parallel", [0, 1]))
    for r in dp.ranks:
        assert r.bytes_stored == ROWS * DIM * 4 and r.lookups == IDS
        assert r.bytes_sent == r.bytes_received == 2 * (1 / 2) * ROWS * DIM * 4


def test_ids_are_priced_at_their_wire_width():
    """The input dist sends checked ids in the narrowest type of the shard's row range."""
    assert [
        wire_id_bytes(rows, False) for rows in (256, 257, 2**16, 2**16 + 1, 2**31, 2**31 + 1)
    ] == [1, 2, 2, 4, 4, 8]
    assert wire_id_bytes(257, True) == 6  # + an fp32 weight per id


def test_table_row_wise_keeps_rows_in_one_host():
    stats = _stats(_plan("table_row_wise", [2, 3]), world=4, local=2)
    half = ROWS // 2 * DIM * 4
    assert [r.bytes_stored for r in stats.ranks] == [0, 0, half, half]
    assert sum(r.bytes_sent for r in stats.ranks) == pytest.approx(
        sum(r.bytes_received for r in stats.ranks)
    )


def test_unknown_table_is_named():
    plan = ShardingPlan(
        {
            "m": {
                "nope": ParameterSharding(
                    "table_wise", "fused", [0], make_shards("table_wise", 4, 4, [0])
                )
            }
        }
    )
    with pytest.raises(ValueError, match="table 'm.nope': in the plan but not among the tables"):
        _stats(plan)


def test_matches_the_planners_own_estimate():
    tables = [
        TableMeta(f"t{i}", 5000 * (i + 1), 32, pooling_factors=[float(i + 1)]) for i in range(5)
    ]
    topo = Topology(4, local_world_size=2)
    planner = EmbeddingShardingPlanner(topo, 256, debug=False)
    plan = planner.plan_tables(tables)
    stats = plan_stats(plan, tables, topo, 256)
    assert stats.max("total_ms") == pytest.approx(planner.last_stats.max_time)


def test_cli_prints_stats_of_an_existing_plan(tmp_path, capsys):
    tables = tmp_path / "tables.json"
    tables.write_text(
        json.dumps(
            [{"name": "t", "num_embeddings": ROWS, "embedding_dim": DIM, "pooling_factor": POOLING}]
        )
    )
    path = str(tmp_path / "plan.json")
    save_plan(_plan("table_wise", [1]), path)
    assert main([str(tables), "--world-size", "2", "--batch-size", str(BATCH), "--plan", path]) == 0
    out = capsys.readouterr().out
    assert "bytes" not in out.split("\n")[0] and "sent MiB" in out and "predicted step" in out
    assert "evaluated" not in out  # no planning
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert float(lines["1"][1]) == pytest.approx(ROWS * DIM * 4 / 2**20, abs=1e-3)
    (tmp_path / "bad.json").write_text("{}")
    assert main([str(tables), "--world-size", "2", "--plan", str(tmp_path / "bad.json")]) == 1
