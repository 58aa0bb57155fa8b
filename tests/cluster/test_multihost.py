"""The stock launcher across 2 simulated hosts: `torchrun --nnodes 2 --nproc_per_node 2
--rdzv-backend c10d --rdzv-endpoint host0:PORT` runs the sharded-vs-unsharded equivalence
cases (TW, RW, CW, TWRW, DP) and the EBC benchmark (with the planner told the topology) to
the end, with torchrun's node ranks and
LOCAL_WORLD_SIZE. (The DLRM main job runs there in test_elastic.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import torchrun

from scripts.cluster import Cluster

pytestmark = pytest.mark.cluster


def test_sharded_ebc_equals_unsharded_on_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "results"
    out.mkdir()
    job = torchrun(cluster, ["tests/cluster/equivalence_worker.py", str(out)], tmp_path)
    assert job.wait(timeout=240) == [0, 0], job.output()
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    hosts = [r["host"] for r in records]  # node-major ranks: 2 per host, on both hosts
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and set(hosts) == {"host0", "host1"}
    assert all(r["env"]["LOCAL_WORLD_SIZE"] == "2" for r in records)
    kinds = {case.split("/")[0] for case in records[0]["results"]}
    assert kinds == {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}
    failures = {
        f"rank {r['rank']} {case}": problems
        for r in records
        for case, problems in r["results"].items()
        if problems
    }
    assert not failures, "\n".join(f"{c}: {p}" for c, p in failures.items())


@pytest.mark.slow
def test_ebc_benchmark_runs_on_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    job = torchrun(
        cluster,
        [
            "-m",
            "benchmarks.ebc",
            "--quick",
            "--types",
            "row_wise,table_row_wise,planner",
            "--inter-host-gbps",
            "1",
        ],
        tmp_path,
    )
    assert job.wait(timeout=180) == [0, 0], job.output()
    lines = [json.loads(line) for line in job.output(0).splitlines() if line.startswith("{")]
    setup = next(r for r in lines if r["bench"] == "ebc_setup")
    assert (setup["world_size"], setup["hosts"], setup["ranks_per_host"]) == (4, 2, 2)
    assert setup["launcher"] == "torchrun"
    steps = {r["name"]: r for r in lines if r["bench"] == "ebc_step"}
    assert set(steps) == {"row_wise", "table_row_wise", "planner"}
    assert all(r["median_step_ms"] > 0 and r["world_size"] == 4 for r in steps.values())


@pytest.mark.slow  # ~16 s; the two-host equivalence below runs in make test
def test_launched_fresh_ranks_start_new_processes_on_every_host(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`benchmarks.ranks.launched_fresh_ranks` (planner_accuracy under torchrun): each run is
    a new gloo group of new processes, rank r on launched rank r's host, torchrun's layout."""
    out = tmp_path / "results"
    out.mkdir()
    job = torchrun(cluster, ["tests/cluster/fresh_ranks_worker.py", str(out)], tmp_path)
    assert job.wait(timeout=180) == [0, 0], job.output()
    found = json.loads((out / "fresh.json").read_text())
    launched, runs = found["launched"], found["runs"]
    assert [h["host"] for h in launched] == ["host0", "host0", "host1", "host1"]
    pids = set()
    for tag, run in zip(("first", "second"), runs):
        assert [r["rank"] for r in run] == [0, 1, 2, 3] and {r["tag"] for r in run} == {tag}
        assert all(r["world"] == 4 and r["rank_sum"] == 6.0 for r in run)
        assert [r["host"] for r in run] == [h["host"] for h in launched]
        assert [(r["local_rank"], r["local_world_size"]) for r in run] == [
            ("0", "2"),
            ("1", "2"),
            ("0", "2"),
            ("1", "2"),
        ]
        pids |= {r["pid"] for r in run}
    assert len(pids) == 8 and not pids & {h["pid"] for h in launched}


@pytest.mark.slow
def test_planner_accuracy_runs_on_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    """Issue #22's accuracy benchmark under torchrun on 2 hosts x 2 ranks (quick sizes): its
    own calibration there, then every plan in fresh processes of that layout."""
    job = torchrun(
        cluster, ["-m", "benchmarks.planner_accuracy", "--quick", "--ids", "uniform"], tmp_path
    )
    assert job.wait(timeout=600) == [0, 0], job.output()
    lines = [json.loads(line) for line in job.output(0).splitlines() if line.startswith("{")]
    setup = next(r for r in lines if r["bench"] == "planner_accuracy_setup")
    assert (setup["world_size"], setup["local_world_size"]) == (4, 2)
    assert {"all_to_all/inter", "all_to_all/intra"} <= set(setup["links"])
    runs = [r for r in lines if r["bench"] == "planner_accuracy"]
    assert {r["plan"] for r in runs} == {
        "table_wise",
        "row_wise",
        "column_wise",
        "table_row_wise",
        "data_parallel",
        "planner",
    }
    assert all(r["measured_ms"] > 0 and r["memory_measured_mb"] > 0 for r in runs)
    assert lines[-1]["bench"] == "planner_accuracy_summary"
