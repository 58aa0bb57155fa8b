"""`recshard-plan` checks every number it is given (issue #37, item 8): flags and the tables
file's numbers must be finite and in range, JSON inputs are bounded in size, nesting depth and
table count; each failure is exit status 2 with one line on stderr, no traceback. Before, a
negative `--inter-host-gbps` printed negative step times and exited 0, NaN printed NaN, 0 died
with ZeroDivisionError, a deeply nested plan gave a bare RecursionError and a 10^6-table plan
took 19 s to be refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recshard.planner import Topology, load_plan
from recshard.planner.json_input import MAX_DEPTH, MAX_FILE_BYTES, MAX_TABLES, InputLimitError
from recshard.planner.report.cli import main

_GOOD = {"name": "t", "num_embeddings": 1000, "embedding_dim": 16}


@pytest.fixture
def tables(tmp_path: Path) -> str:
    path = tmp_path / "tables.json"
    path.write_text(json.dumps([_GOOD]))
    return str(path)


def _one_line_error(capsys: pytest.CaptureFixture) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "flag, value, rule",
    [
        ("--inter-host-gbps", "-1", "a finite number > 0"),
        ("--inter-host-gbps", "nan", "a finite number > 0"),
        ("--inter-host-gbps", "0", "a finite number > 0"),
        ("--intra-host-gbps", "inf", "a finite number > 0"),
        ("--ddr-gb", "-1", "a finite number >= 0"),
        ("--hbm-gb", "nan", "a finite number >= 0"),
        ("--dense-gb", "-0.5", "a finite number >= 0"),
        ("--kjt-gb", "inf", "a finite number >= 0"),
        ("--timeout", "0", "a finite number > 0"),
        ("--timeout", "nan", "a finite number > 0"),
        ("--world-size", "0", "an integer > 0"),
        ("--batch-size", "-4", "an integer > 0"),
        ("--local-world-size", "1.5", "an integer > 0"),
        ("--max-table-rows", "-1", "an integer >= 0"),
    ],
)
def test_bad_flag_numbers_exit_2_with_one_line(
    tables: str, capsys: pytest.CaptureFixture, flag: str, value: str, rule: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main([tables, f"{flag}={value}"])
    assert info.value.code == 2
    err = _one_line_error(capsys)
    assert f"argument {flag}: must be {rule}, got '{value}'" in err, err


@pytest.mark.parametrize(
    "content, message",
    [
        ([{**_GOOD, "pooling_factor": -2}], "'pooling_factor' must be finite numbers > 0, got -2"),
        (
            '[{"name": "t", "num_embeddings": 10, "embedding_dim": 4, "pooling_factor": NaN}]',
            "'pooling_factor' must be finite numbers > 0, got nan",
        ),
        (
            '[{"name": "t", "num_embeddings": 10, "embedding_dim": 4, "pooling_factor": Infinity}]',
            "'pooling_factor' must be finite numbers > 0, got inf",
        ),
        ([{**_GOOD, "batch_sizes": [-1]}], "'batch_sizes' must be integers >= 1, got -1"),
        ([{**_GOOD, "num_embeddings": True}], "'num_embeddings' must be an integer >= 1, got True"),
        ([{**_GOOD, "embedding_dim": 0}], "'embedding_dim' must be an integer >= 1, got 0"),
        ({"tables": [_GOOD], "world_size": 0}, "world_size must be an integer >= 1, got 0"),
        ({"tables": [_GOOD], "batch_size": 2.5}, "batch_size must be an integer >= 1, got 2.5"),
    ],
)
def test_bad_file_numbers_exit_2_naming_file_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: object, message: str
) -> None:
    path = tmp_path / "tables.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main([str(path)]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"error: {path}: ") and message in err, err


def test_deeply_nested_inputs_are_refused_by_depth(
    tmp_path: Path, tables: str, capsys: pytest.CaptureFixture
) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)  # past Python's recursion limit
    assert main([str(deep)]) == 2
    assert f"nested more than {MAX_DEPTH} levels deep" in _one_line_error(capsys)
    shallow_but_deep = tmp_path / "plan.json"
    shallow_but_deep.write_text("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert main([tables, "--plan", str(shallow_but_deep)]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"error: {shallow_but_deep}: nested more than {MAX_DEPTH}"), err


def _plan_of(count: int) -> str:
    entry = '{"sharding_type":"data_parallel","compute_kernel":"dense"}'
    body = ",".join(f'"t{i}":{entry}' for i in range(count))
    return f'{{"format":"recshard.sharding_plan","version":1,"modules":{{"":{{{body}}}}}}}'


def test_too_many_tables_are_refused_before_any_is_read(
    tmp_path: Path, tables: str, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_plan_of(MAX_TABLES + 1))
    with pytest.raises(InputLimitError, match=f"{MAX_TABLES + 1} tables, more than the"):
        load_plan(str(path))
    assert main([tables, "--plan", str(path)]) == 2
    assert f"{MAX_TABLES + 1} tables" in _one_line_error(capsys)
    many = tmp_path / "tables_many.json"
    many.write_text(json.dumps([{**_GOOD, "name": f"t{i}"} for i in range(MAX_TABLES + 1)]))
    assert main([str(many)]) == 2
    assert f"{MAX_TABLES + 1} tables, more than" in _one_line_error(capsys)


def test_a_million_table_plan_is_refused_by_its_size(
    tmp_path: Path, tables: str, capsys: pytest.CaptureFixture
) -> None:
    """A 10^6-table plan is ~60 MB: refused from its size, before it is parsed."""
    path = tmp_path / "plan.json"
    with open(path, "w") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no parse could succeed, none is tried
    assert main([tables, "--plan", str(path)]) == 2
    assert f"{MAX_FILE_BYTES + 1} bytes, more than the" in _one_line_error(capsys)
    assert len(_plan_of(10**6)) > MAX_FILE_BYTES


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"inter_host_bw": -1.0}, "inter_host_bw must be a finite number > 0, got -1.0"),
        ({"intra_host_bw": float("nan")}, "intra_host_bw must be a finite number > 0, got nan"),
        ({"inter_host_bw": 0}, "inter_host_bw must be a finite number > 0, got 0"),
        ({"ddr_cap": float("inf")}, "ddr_cap must be a finite number >= 0, got inf"),
        ({"uvm_efficiency": 0.0}, "uvm_efficiency must be in (0, 1], got 0.0"),
    ],
)
def test_topology_refuses_bad_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Topology(4, local_world_size=2, **kwargs)
