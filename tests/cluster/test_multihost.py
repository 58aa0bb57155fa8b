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
    failures = {f"rank {r['rank']} {case}": problems for r in records
                for case, problems in r["results"].items() if problems}
    assert not failures, "\n".join(f"{c}: {p}" for c, p in failures.items())


def test_ebc_benchmark_runs_on_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    job = torchrun(cluster, ["-m", "benchmarks.ebc", "--quick", "--types",
                             "row_wise,table_row_wise,planner", "--inter-host-gbps", "1"],
                   tmp_path)
    assert job.wait(timeout=180) == [0, 0], job.output()
    lines = [json.loads(line) for line in job.output(0).splitlines() if line.startswith("{")]
    setup = next(r for r in lines if r["bench"] == "ebc_setup")
    assert (setup["world_size"], setup["hosts"], setup["ranks_per_host"]) == (4, 2, 2)
    assert setup["launcher"] == "torchrun"
    steps = {r["name"]: r for r in lines if r["bench"] == "ebc_step"}
    assert set(steps) == {"row_wise", "table_row_wise", "planner"}
    assert all(r["median_step_ms"] > 0 and r["world_size"] == 4 for r in steps.values())
