"""DLRM with key-value tables on 2 gloo ranks: `--key-value-tables` trains those tables from
files under `--kv-dir` (losses close to the in-memory run's), and `--dram-budget` makes the
planner put the table that does not fit on key_value."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, List

from multiprocess import run_ranks
from test_dlrm_train import TINY

from recshard.planner import load_plan


def _run_many(rank: int, world_size: int, argvs: List[List[str]]) -> List[Dict[str, Any]]:
    from examples.dlrm.args import parse_args
    from examples.dlrm.train import run

    return [run(parse_args(argv)) for argv in argvs]


def _kernels(plan_path: Path) -> Dict[str, str]:
    plan = load_plan(str(plan_path))
    return {name: ps.compute_kernel for module in plan.plan.values() for name, ps in module.items()}


def test_key_value_tables_train_like_fused(tmp_path: Path) -> None:
    os.mkdir(tmp_path / "0")
    base = TINY + ["--steps", "4", "--batch-size", "32", "--eval-batches", "2"]
    base += ["--sharding", "row_wise"]
    kv_plan = tmp_path / "kv.json"
    key_value = [
        "--key-value-tables",
        "t_cat_0,t_cat_3",
        "--kv-dir",
        str(tmp_path / "@local_rank"),
        "--cache-load-factor",
        "0.5",
        "--save-plan",
        str(kv_plan),
    ]
    fused, kv = run_ranks(2, _run_many, [base, base + key_value], timeout=240)[0]
    # same data and plan; the key_value tables draw their initial rows in another order (in
    # chunks, as they are written to storage), so the losses are close, not equal
    assert len(kv["losses"]) == 4 and all(math.isfinite(v) for v in kv["losses"])
    assert max(abs(a - b) for a, b in zip(kv["losses"], fused["losses"])) < 0.02
    kernels = _kernels(kv_plan)
    assert kernels["t_cat_0"] == kernels["t_cat_3"] == "key_value"
    assert {k for n, k in kernels.items() if n not in ("t_cat_0", "t_cat_3")} == {"fused"}
    # run_ranks sets no LOCAL_RANK (torchrun does): both ranks' shards share directory 0
    files = os.listdir(tmp_path / "0")
    assert {"t_cat_0.r0.c0.250x8.weight", "t_cat_0.r250.c0.250x8.weight"} <= set(files), files


def test_dram_budget_plans_the_big_table_key_value(tmp_path: Path) -> None:
    sizes = ",".join(["2000000"] + ["500"] * 25)
    plan = tmp_path / "plan.json"
    argv = TINY + ["--num-embeddings-per-feature", sizes, "--steps", "3", "--batch-size", "32"]
    argv += ["--eval-batches", "1", "--dram-budget", "0.09", "--save-plan", str(plan)]
    summaries = run_ranks(2, _run_many, [argv], timeout=240)
    kernels = _kernels(plan)
    assert kernels.pop("t_cat_0") == "key_value" and set(kernels.values()) == {"fused"}
    assert all(s[0]["final_loss_ema"] == s[0]["final_loss_ema"] for s in summaries)  # not NaN
