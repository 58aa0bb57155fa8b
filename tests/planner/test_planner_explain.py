"""`--explain TABLE`: every option priced for the table, the plan estimate with each, and
why the chosen one won; `--png` with a measurement file."""

from __future__ import annotations

import json
import math
import os

import pytest

from recshard.planner import EmbeddingShardingPlanner, TableMeta, Topology
from recshard.planner.report.cli import main
from recshard.planner.report.explain import explain_table, read_measurements

TABLES = [
    TableMeta("big", 2_000_000, 128, pooling_factors=[20.0]),
    TableMeta("mid", 200_000, 64, pooling_factors=[5.0]),
    TableMeta("small", 1000, 16),
]


def _explain(name: str, **topo):
    planner = EmbeddingShardingPlanner(Topology(4, **topo), 2048, debug=False)
    plan = planner.plan_tables(TABLES)
    return planner, plan, explain_table(planner, TABLES, name)


def test_every_option_priced_and_the_chosen_one_is_the_plans():
    planner, plan, ex = _explain("big", local_world_size=2)
    chosen = ex.chosen
    ps = plan.plan[""]["big"]
    assert (chosen.sharding_type, chosen.compute_kernel) == (ps.sharding_type, ps.compute_kernel)
    assert chosen.ranks == ps.ranks
    assert ex.plan_ms == pytest.approx(planner.last_stats.max_time)
    kinds = {o.sharding_type for o in ex.options}
    assert {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"} <= kinds
    for o in ex.options:
        assert o.fwd_ms > 0 and o.bwd_ms > 0 and o.memory > 0
        assert o.comm_ms > 0
    # no alternative beats the choice unless the reason says the search missed it
    if any(o.plan_ms < chosen.plan_ms for o in ex.options if not o.chosen):
        assert "did not reach" in ex.reason
    else:
        assert "Next best" in ex.reason
    text = ex.format()
    assert text.count("\n") >= len(ex.options) + 2 and "* " in text


def test_options_that_do_not_fit_are_marked():
    # 1 GiB DDR per rank: a 2M x 128 fp32 replica on every rank (data-parallel) cannot fit
    _, _, ex = _explain("big", ddr_cap=1.5 * 2**30)
    dp = next(o for o in ex.options if o.sharding_type == "data_parallel")
    assert math.isinf(dp.plan_ms) and "do not fit" in ex.reason
    assert "does not fit" in ex.format()


def test_cli_explain_and_png_with_measurements(tmp_path, capsys):
    tables = tmp_path / "tables.json"
    tables.write_text(
        json.dumps(
            [
                {
                    "name": t.name,
                    "num_embeddings": t.num_embeddings,
                    "embedding_dim": t.embedding_dim,
                    "pooling_factor": (t.pooling_factors or [1.0])[0],
                }
                for t in TABLES
            ]
        )
    )
    assert main([str(tables), "--world-size", "4", "--explain", "mid"]) == 0
    out = capsys.readouterr().out
    assert "table 'mid':" in out and "chosen:" in out
    assert main([str(tables), "--world-size", "4", "--explain", "nope"]) == 1
    assert "table 'nope' not found" in capsys.readouterr().err
    measured = tmp_path / "m.jsonl"
    measured.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"bench": "setup"},
                {"workload": "w", "plan": "planner", "predicted_ms": 3.0, "measured_ms": 3.3},
                {"workload": "w", "plan": "row_wise", "predicted_ms": 4.0, "measured_ms": 3.8},
            ]
        )
        + "\n"
    )
    assert [r["plan"] for r in read_measurements(str(measured))] == ["planner", "row_wise"]
    png = str(tmp_path / "explain.png")
    args = [
        str(tables),
        "--world-size",
        "4",
        "--explain",
        "big",
        "--png",
        png,
        "--measured",
        str(measured),
    ]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(args) == 1
    else:
        assert main(args) == 0 and os.path.getsize(png) > 0
    (tmp_path / "empty.jsonl").write_text("{}\n")
    assert main(args[:-1] + [str(tmp_path / "empty.jsonl")]) == 1
