"""`recshard-plan` end to end in a subprocess: tables printed, JSON written, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recshard.planner import load_plan
from recshard.planner.report.cli import main

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TABLES = {
    "optimizer": "exact_row_wise_adagrad",
    "tables": [
        {"name": "user", "num_embeddings": 2_000_000, "embedding_dim": 128, "pooling_factor": 1},
        {
            "name": "item",
            "num_embeddings": 500_000,
            "embedding_dim": 64,
            "feature_names": ["item", "item_hist"],
            "pooling_factor": [1, 20],
            "module": "sparse.ebc",
        },
        {"name": "tiny", "num_embeddings": 100, "embedding_dim": 16, "weighted": True},
        {
            "name": "wide",
            "num_embeddings": 10_000,
            "embedding_dim": 256,
            "constraints": {"sharding_types": ["column_wise"], "min_partition": 64},
        },
    ],
}


def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "recshard.planner", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tables_file(tmp_path):
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(TABLES))
    return str(path)


def test_cli_prints_tables_and_writes_plan(tables_file, tmp_path):
    out = str(tmp_path / "plan.json")
    proc = _run(
        [
            tables_file,
            "--world-size",
            "4",
            "--local-world-size",
            "2",
            "--compute-device",
            "cuda",
            "--hbm-gb",
            "16",
            "--batch-size",
            "256",
            "-o",
            out,
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "imbalance (max/mean)" in proc.stdout
    assert "| rank |" in proc.stdout and "sparse.ebc.item" in proc.stdout
    plan = load_plan(out)
    assert set(plan.plan) == {"", "sparse.ebc"}
    assert plan.plan[""]["wide"].sharding_type == "column_wise"
    assert len(plan.plan[""]["wide"].shards) in (2, 4)
    data = json.loads(open(out).read())
    assert data["version"] == 1 and data["metadata"]["world_size"] == 4


def test_cli_exit_2_when_nothing_fits(tables_file, tmp_path):
    proc = _run([tables_file, "--world-size", "2", "--ddr-gb", "0.5"], tmp_path)
    assert proc.returncode == 2
    assert "no sharding plan fits" in proc.stderr and "user (2000000 x 128" in proc.stderr


def test_cli_bad_input_names_the_table(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps([{"name": "t", "num_embeddings": 10, "embedding_dim": 4, "pooling": 3}])
    )
    assert main([str(path)]) == 1
    assert "table 't': unknown keys ['pooling']" in capsys.readouterr().err


def test_cli_png(tables_file, tmp_path, capsys):
    png = str(tmp_path / "p.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main([tables_file, "--png", png]) == 1
        assert "needs matplotlib" in capsys.readouterr().err
    else:
        assert main([tables_file, "--png", png]) == 0
        assert os.path.getsize(png) > 0


_GOOD = {"name": "t", "num_embeddings": 1000, "embedding_dim": 16}
_BAD_INPUT = [  # numbers out of range: tests/planner/test_planner_cli_numbers.py
    (
        "string features",
        [{**_GOOD, "feature_names": "user"}],
        [],
        "table 't': 'feature_names' must be a non-empty list of names, got 'user'",
    ),
    ("empty list", [], [], "the table list is empty"),
    ("malformed json", '[{"name": "t",', [], "not valid JSON"),
    ("not utf-8", b'[{"name": "\xff"}]', [], "not UTF-8 text"),
]


@pytest.mark.parametrize("case", _BAD_INPUT, ids=[c[0] for c in _BAD_INPUT])
def test_cli_bad_input_exits_1_naming_file_and_table(case, tmp_path, capsys):
    _, content, flags, message = case
    path = tmp_path / "tables.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main([str(path), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and message in err, err
    assert "Traceback" not in err


def _plan_file(tmp_path, change) -> str:
    entry = {
        "sharding_type": "table_wise",
        "compute_kernel": "fused",
        "ranks": [0],
        "shards": [{"offsets": [0, 0], "sizes": [10, 4], "placement": "rank:0/cpu"}],
        "bounds_check_mode": None,
        "cache_params": None,
    }
    data = {
        "format": "recshard.sharding_plan",
        "version": 1,
        "metadata": {},
        "modules": {"ebc": {"t": entry}},
    }
    change(data, entry)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


_BAD_PLANS = [
    (
        "garbage placement",
        lambda d, e: e["shards"][0].update(placement="garbage"),
        'table \'ebc.t\': $.modules["ebc"]["t"].shards[0].placement: '
        "expected 'rank:<r>/<device>'",
    ),
    ("modules as a list", lambda d, e: d.update(modules=[]), "$.modules: expected dict"),
    (
        "bad bounds mode",
        lambda d, e: e.update(bounds_check_mode="loud"),
        "table 'ebc.t': $.modules[\"ebc\"][\"t\"].bounds_check_mode: 'loud' is not one of",
    ),
    (
        "ranks disagree",
        lambda d, e: e["shards"][0].update(placement="rank:1/cpu"),
        'table \'ebc.t\': $.modules["ebc"]["t"].ranks: [0] do not agree with the shards\' '
        "placements (ranks [1])",
    ),
]


@pytest.mark.parametrize("case", _BAD_PLANS, ids=[c[0] for c in _BAD_PLANS])
def test_load_plan_names_file_json_path_and_table(case, tmp_path):
    from recshard.planner import load_plan
    from recshard.planner.plan_io import PlanValidationError

    _, change, message = case
    path = _plan_file(tmp_path, change)
    with pytest.raises(PlanValidationError) as info:
        load_plan(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), str(info.value)
    assert load_plan(_plan_file(tmp_path, lambda d, e: None)).plan["ebc"]["t"].ranks == [0]


_BAD_PLANS_FOR_TABLES = _BAD_PLANS + [
    (
        "rank outside the world",
        lambda d, e: (e.update(ranks=[5]), e["shards"][0].update(placement="rank:5/cpu")),
        "table 'ebc.t': ranks [5] are outside world size 2",
    ),
    (
        "shards short of the table",
        lambda d, e: e["shards"][0].update(sizes=[6, 4]),
        "table 'ebc.t': row shards cover 6 of 10",
    ),
    (
        "unknown sharding type",
        lambda d, e: e.update(sharding_type="diagonal"),
        "table 'ebc.t': unknown sharding type 'diagonal'",
    ),
    (
        "unknown kernel",
        lambda d, e: e.update(compute_kernel="magic"),
        "table 'ebc.t': unknown compute kernel 'magic'",
    ),
    (
        "table not given",
        lambda d, e: d["modules"]["ebc"].update(u=e),
        "table 'ebc.u': in the plan but not among the tables given",
    ),
    ("not a plan", lambda d, e: d.update(format="other"), "not a recshard sharding plan"),
]


@pytest.mark.parametrize("case", _BAD_PLANS_FOR_TABLES, ids=[c[0] for c in _BAD_PLANS_FOR_TABLES])
def test_cli_bad_plan_file_exits_1_naming_file_and_table(case, tmp_path, capsys):
    """`recshard-plan TABLES --plan BAD` takes the bad-input path: exit 1, one line
    `error: PLAN: table 'X': ...`, no traceback; checked against the tables it is given."""
    _, change, message = case
    tables = tmp_path / "tables.json"
    tables.write_text(
        json.dumps([{"name": "t", "num_embeddings": 10, "embedding_dim": 4, "module": "ebc"}])
    )
    path = _plan_file(tmp_path, change)
    assert main([str(tables), "--world-size", "2", "--plan", path]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_plan_file_missing_a_table_names_it(tmp_path, capsys):
    tables = tmp_path / "tables.json"
    tables.write_text(
        json.dumps(
            [
                {"name": n, "num_embeddings": 10, "embedding_dim": 4, "module": "ebc"}
                for n in ("t", "w")
            ]
        )
    )
    path = _plan_file(tmp_path, lambda d, e: None)
    assert main([str(tables), "--world-size", "2", "--plan", path]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: table 'ebc.w': among the tables but not in the plan")
    assert main([str(tables), "--plan", str(tmp_path / "absent.json")]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'absent.json'}: ")


def _max_memory_mib(out: str) -> float:
    """The `max` row's memory column of `--plan`'s per-rank statistics."""
    header = next(line.split() for line in out.splitlines() if line.startswith("rank "))
    row = next(line.split() for line in out.splitlines() if line.startswith(" max "))
    return float(row[header.index("memory") - 1])  # "rank" is one column, "memory MiB" two


def test_cli_pipeline_type_counts_the_batches_of_ids_in_flight(tmp_path, capsys):
    tables = tmp_path / "tables.json"
    tables.write_text(
        json.dumps(
            {
                "tables": [
                    {
                        "name": "a",
                        "num_embeddings": 100_000,
                        "embedding_dim": 64,
                        "pooling_factor": 20,
                        "constraints": {"sharding_types": ["row_wise"]},
                    },
                    {
                        "name": "b",
                        "num_embeddings": 5_000,
                        "embedding_dim": 32,
                        "pooling_factor": 5,
                        "constraints": {"sharding_types": ["row_wise"]},
                    },
                ]
            }
        )
    )
    plan = str(tmp_path / "plan.json")
    base = [str(tables), "--world-size", "2", "--batch-size", "512"]
    for pipeline in ("none", "train_sparse_dist"):  # plans and explains under either
        assert main(base + ["-o", plan, "--explain", "a", "--pipeline-type", pipeline]) == 0
    capsys.readouterr()
    memory = {}
    for pipeline in ("none", "train_sparse_dist", "train_prefetch_sparse_dist"):
        assert main(base + ["--plan", plan, "--pipeline-type", pipeline]) == 0
        memory[pipeline] = _max_memory_mib(capsys.readouterr().out)
    # a row-wise shard receives half the global batch's ids: (20 + 5) x 1024 / 2, 8 bytes each
    batch_of_ids = 12_800 * 8 / 2**20
    assert memory["train_sparse_dist"] - memory["none"] == pytest.approx(batch_of_ids, abs=2e-3)
    assert memory["train_prefetch_sparse_dist"] - memory["none"] == pytest.approx(
        2 * batch_of_ids, abs=2e-3
    )
