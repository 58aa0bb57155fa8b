"""Fused optimizer state loads into any plan, world size and column layout.

Row-wise Adagrad keeps one accumulator per row, a column-sharded table one per row per column
shard (`momentum1@col<offset>`). Saved column-wise at 2 ranks, it loads row- and table-wise at
1, 2 and 3 ranks as the width-weighted mean of the column shards' (and column-wise with
other blocks as the covering block's value), through `recshard.checkpoint.load` and through
`load_state_dict` with whole tensors; the other way round every column shard gets the row's
value. Per-element Adagrad state reshards exactly. What was loaded is read back from a
checkpoint the loaded model saves.

The oracle for the mean: at a fused learning rate of 0 the tables never move, so every
layout sees the same gradients, and the column-wise accumulators loaded row-wise equal those
of a row-wise run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from dmp_cases import TinyDLRM, make_optimizer, train
from multiprocess import run_ranks

from recshard import checkpoint
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recshard.types import ShardingPlan

TABLES = ["ta", "tb", "tc"]
ROWWISE = "exact_row_wise_adagrad"
ADAGRAD = "exact_adagrad"


def _state(table: str) -> str:
    return f"fused_optim.ebc.embedding_bags.{table}.weight.momentum1"


def build(kind: str, ws: int, optim: str, lr: float) -> DistributedModelParallel:
    per_table = {
        "column_wise": {t: column_wise(list(range(ws))) for t in TABLES},
        "row_wise": {t: row_wise() for t in TABLES},
        "table_wise": {t: table_wise((i + 1) % ws) for i, t in enumerate(TABLES)},
    }[kind]
    plan = construct_module_sharding_plan(TinyDLRM("meta").ebc, per_table, world_size=ws)
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": optim, "learning_rate": lr})
    torch.manual_seed(0)
    return DistributedModelParallel(
        TinyDLRM(), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )


def save_run(rank: int, ws: int, path: str, kind: str, optim: str, lr: float) -> None:
    dmp = build(kind, ws, optim, lr)
    opt = make_optimizer(dmp, True, True)
    train(dmp, opt, range(2), rank, ws)
    checkpoint.save(path, dmp, opt)


def _nested(full: Dict[str, torch.Tensor], section: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """`section.<fqn>.<name>` -> `{fqn: {name: tensor}}` (a KeyedOptimizer's state)."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in full.items():
        if key.startswith(section + "."):
            fqn, _, name = key[len(section) + 1 :].rpartition(".")
            out.setdefault(fqn, {})[name] = value
    return out


def load_runs(
    rank: int, ws: int, src: str, optim: str, cases: List[Tuple[str, str, str]]
) -> List[List[float]]:
    """For each (kind, via, dst): load `src` into `kind` at `ws` ranks, save what was loaded
    to `dst`, train on; the losses of each."""
    losses = []
    for kind, via, dst in cases:
        dmp = build(kind, ws, optim, 0.05)
        opt = make_optimizer(dmp, True, True)
        if via == "checkpoint":
            checkpoint.load(src, dmp, opt)
        else:  # "state_dict": whole tensors, as an unsharded or gathered state dict holds them
            full = checkpoint.read_checkpoint(src)
            model = {k[len("model.") :]: v for k, v in full.items() if k.startswith("model.")}
            dmp.load_state_dict(model)
            opt.load_state_dict(
                {"state": {**_nested(full, "fused_optim"), **_nested(full, "dense_optim")}}
            )
        checkpoint.save(dst, dmp, opt)
        losses.append(train(dmp, opt, range(2, 4), rank, ws))
    return losses


Loaded = Tuple[List[float], Dict[str, torch.Tensor]]  # losses after the load, what was loaded


def _load(src: str, ws: int, optim: str, cases: List[Tuple[str, str]]) -> List[Loaded]:
    """`load_runs` on `ws` ranks (one process group for all `cases`)."""
    with tempfile.TemporaryDirectory() as out:
        dsts = [str(Path(out) / str(i)) for i in range(len(cases))]
        cases_at = [(kind, via, dst) for (kind, via), dst in zip(cases, dsts)]
        losses = run_ranks(ws, load_runs, src, optim, cases_at, timeout=300)[0]
        return [(loss, checkpoint.read_checkpoint(dst)) for loss, dst in zip(losses, dsts)]


def _weights(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith("model.")}


def _assert_equal_weights(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> None:
    assert _weights(got).keys() == _weights(want).keys()
    for key, value in _weights(want).items():
        assert torch.equal(got[key], value), key


@pytest.mark.slow  # 4 process groups, 10 loads: ~15 s on an idle 2-core machine
def test_rowwise_state_saved_column_wise_loads_row_table_and_column_wise(tmp_path: Path) -> None:
    src = str(tmp_path / "cw")
    run_ranks(2, save_run, src, "column_wise", ROWWISE, 0.05, timeout=180)
    saved = checkpoint.read_checkpoint(src)
    left = {t: saved[f"{_state(t)}@col0"] for t in TABLES}  # columns 0..1
    right = {t: saved[f"{_state(t)}@col2"] for t in TABLES}  # columns 2..3
    mean = {t: (2 * left[t] + 2 * right[t]) / 4 for t in TABLES}
    assert all(not torch.equal(left[t], right[t]) for t in TABLES)  # a real difference

    whole_rows: List[List[float]] = []
    for ws, cases in [
        (
            1,
            [
                ("row_wise", "checkpoint"),
                ("table_wise", "state_dict"),
                ("column_wise", "checkpoint"),
            ],
        ),
        (2, [("table_wise", "checkpoint"), ("row_wise", "state_dict")]),
        (3, [("row_wise", "checkpoint"), ("table_wise", "state_dict")]),
    ]:
        for (kind, via), (losses, state) in zip(cases, _load(src, ws, ROWWISE, cases)):
            _assert_equal_weights(state, saved)
            for t in TABLES:  # at 1 rank column-wise is one block of all four columns
                key = _state(t) + ("@col0" if kind == "column_wise" else "")
                torch.testing.assert_close(state[key], mean[t], msg=f"{ws} {kind} {via} {t}")
            whole_rows.append(losses)
    for losses in whole_rows[1:]:  # same weights, same accumulators: the same training
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole_rows[0]))

    # Blocks of 2, 1, 1 columns: each lies inside one saved block and takes its value.
    cases = [("column_wise", "checkpoint"), ("column_wise", "state_dict")]
    for _, state in _load(src, 3, ROWWISE, cases):
        _assert_equal_weights(state, saved)
        for t in TABLES:
            assert torch.equal(state[f"{_state(t)}@col0"], left[t])
            assert torch.equal(state[f"{_state(t)}@col2"], right[t])
            assert torch.equal(state[f"{_state(t)}@col3"], right[t])


def test_column_wise_mean_equals_the_row_wise_accumulator(tmp_path: Path) -> None:
    """At fused lr 0 the gradients do not depend on the layout: the column-wise run's
    accumulators, loaded row-wise, are the row-wise run's."""
    cw, rw = str(tmp_path / "cw"), str(tmp_path / "rw")
    run_ranks(2, save_run, cw, "column_wise", ROWWISE, 0.0, timeout=180)
    run_ranks(1, save_run, rw, "row_wise", ROWWISE, 0.0, timeout=180)
    reference = checkpoint.read_checkpoint(rw)
    (_, loaded), *_ = _load(cw, 1, ROWWISE, [("row_wise", "checkpoint")])
    for t in TABLES:
        assert reference[_state(t)].abs().sum() > 0
        torch.testing.assert_close(loaded[_state(t)], reference[_state(t)], rtol=1e-5, atol=0)


def test_row_wise_state_gives_every_column_shard_the_rows_value(tmp_path: Path) -> None:
    src = str(tmp_path / "rw")
    run_ranks(2, save_run, src, "row_wise", ROWWISE, 0.05, timeout=180)
    saved = checkpoint.read_checkpoint(src)
    for ws, via, offsets in [(2, "checkpoint", [0, 2]), (3, "state_dict", [0, 2, 3])]:
        (_, state), *_ = _load(src, ws, ROWWISE, [("column_wise", via)])
        _assert_equal_weights(state, saved)
        for t in TABLES:
            for offset in offsets:
                assert torch.equal(state[f"{_state(t)}@col{offset}"], saved[_state(t)])


@pytest.mark.slow  # 25-215 s on 2 busy cores: make test stays under 15 min
def test_per_element_adagrad_state_reshards_exactly(tmp_path: Path) -> None:
    src = str(tmp_path / "cw")
    run_ranks(2, save_run, src, "column_wise", ADAGRAD, 0.05, timeout=180)
    saved = checkpoint.read_checkpoint(src)
    for _, state in _load(
        src, 3, ADAGRAD, [("row_wise", "checkpoint"), ("table_wise", "state_dict")]
    ):
        _assert_equal_weights(state, saved)
        for t in TABLES:
            assert saved[_state(t)].shape == saved[f"model.ebc.embedding_bags.{t}.weight"].shape
            assert torch.equal(state[_state(t)], saved[_state(t)])


def sharded_from_another_plan(rank: int, ws: int) -> str:
    """ShardedTensors of another plan cannot be copied in place: a clear error on every rank."""
    column = build("column_wise", ws, ROWWISE, 0.05)
    rows = build("row_wise", ws, ROWWISE, 0.05)
    with pytest.raises(ValueError) as error:
        rows.fused_optimizer.load_state_dict(column.fused_optimizer.state_dict())
    return str(error.value)


def test_sharded_state_of_another_column_layout_is_refused_clearly() -> None:
    for message in run_ranks(2, sharded_from_another_plan, timeout=120):
        assert "embedding_bags.ta.weight.momentum1" in message
        assert "['momentum1@col0', 'momentum1@col2']" in message
        assert "recshard.checkpoint.load" in message
