"""Managed collision state in checkpoints: saved at world size 2 between evictions (t0 evicts
every 2 steps, saved after 7), loaded at 1 and 3: every id keeps its row, the ids counted since
the last eviction are kept, and training goes on as the unsharded model's does."""

from __future__ import annotations

import tempfile
from typing import List

import pytest
import torch
from mc_cases import LR, SparseModel, kjt_of, local_ids
from multiprocess import run_ranks

from recshard import checkpoint
from recshard.distributed import DistributedModelParallel
from recshard.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recshard.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recshard.types import ShardingPlan

SAVED_AT, BEFORE, AFTER = 2, 7, 4


def _dmp(ws: int = 0, placed: str = "") -> DistributedModelParallel:
    """The planner's plan; or `placed`: "tw" t0 table-wise on the last rank, t1
    table-row-wise; "cw" t0 column-wise over the first and last ranks, t1 table-column-wise
    (their modules replicated on the column shards' ranks)."""
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LR}
    )
    model = SparseModel(6)
    plan = None
    if placed:
        per_table = {"t0": table_wise(ws - 1), "t1": table_row_wise(0)}
        if placed == "cw":
            per_table = {"t0": column_wise([0, ws - 1]), "t1": table_column_wise(0)}
        plan = ShardingPlan(
            {
                "sparse": construct_module_sharding_plan(
                    model.sparse, per_table, sharder=sharder, world_size=ws
                )
            }
        )
    return DistributedModelParallel(model, plan=plan, sharders=[sharder])


def _global_batch(step: int, ws: int):
    return kjt_of([local_ids(step, r) for r in range(ws)])


def _train_and_save(rank: int, ws: int, path: str, placed: str) -> None:
    dmp = _dmp(ws, placed)
    for step in range(BEFORE):
        dmp(kjt_of([local_ids(step, rank)])).sum().backward()
    checkpoint.save(path, dmp)


def _load_and_go_on(rank: int, ws: int, path: str, placed: str) -> List[str]:
    """The reference trains unsharded on the saving run's global batches, then on this run's."""
    reference = SparseModel(6)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(BEFORE):
        opt.zero_grad()
        (reference(_global_batch(step, SAVED_AT)).sum() / SAVED_AT).backward()
        opt.step()
    dmp = _dmp(ws, placed)
    checkpoint.load(path, dmp)
    sharded = next(
        m for m in dmp.modules() if isinstance(m, BaseShardedManagedCollisionEmbeddingCollection)
    )
    ref_modules = reference.sparse._managed_collision_collection.modules_by_table()
    problems = []
    for step in range(BEFORE, BEFORE + AFTER):
        for table, local in sharded._managed_collision_collection.local_modules().items():
            lo, hi = local.row_range()
            if not torch.equal(local._mch_raw_ids, ref_modules[table]._mch_raw_ids[lo:hi]):
                problems.append(f"step {step}: table {table} rows {lo}:{hi} hold other ids")
            if int(local._current_iter_tensor) != int(ref_modules[table]._current_iter_tensor):
                problems.append(f"step {step}: table {table} iteration differs")
            first, last = local.bucket_range()
            ref_history = ref_modules[table]._history_accumulator
            ref_history = ref_history[(ref_history % 6 >= first) & (ref_history % 6 < last)]
            if not torch.equal(local._history_accumulator.sort().values, ref_history.sort().values):
                problems.append(f"step {step}: table {table} history differs")
            elif table == "t0" and step == BEFORE and ref_history.numel() == 0 and last > first:
                problems.append("t0 counted no ids since its last eviction: nothing was checked")
        out = dmp(kjt_of([local_ids(step, rank)]))
        out.sum().backward()
        ref_out = reference(_global_batch(step, ws))
        opt.zero_grad()
        (ref_out.sum() / ws).backward()
        opt.step()
        want = ref_out.detach()[rank * 4 : (rank + 1) * 4]
        if not torch.allclose(out.detach(), want, atol=1e-5):
            problems.append(f"step {step}: outputs differ by {(out - want).abs().max():.3g}")
    held = sum(
        int(m._mch_raw_ids.ne(torch.iinfo(torch.int64).max).sum()) for m in ref_modules.values()
    )
    if held == 0:
        problems.append("no id held a row: nothing was checked")
    return problems


@pytest.mark.parametrize("placed", ["", "tw", "cw"])
def test_saved_at_two_ranks_loads_at_one_and_three(placed: str) -> None:
    """Planner plans; table-wise / table-row-wise tables (saved with rank 0 holding no row
    of t0, loaded with all of t0 on the last rank); column-split tables (one replica saves,
    every replica loads the whole state)."""
    with tempfile.TemporaryDirectory() as path:
        run_ranks(SAVED_AT, _train_and_save, path, placed, timeout=180)
        for ws in (1, 3):
            results = run_ranks(ws, _load_and_go_on, path, placed, timeout=180)
            for rank, problems in enumerate(results):
                assert not problems, f"world size {ws}, rank {rank}: {problems}"


def test_state_dict_keys_and_shapes_match_the_unsharded_module() -> None:
    reference = SparseModel(6).state_dict()
    found = run_ranks(2, _state_dict_shapes, timeout=120)
    want = {k: tuple(v.shape) for k, v in reference.items()}
    for rank, shapes in enumerate(found):
        assert shapes == want, f"rank {rank}"


def _state_dict_shapes(rank: int, ws: int) -> dict:
    return {k: tuple(v.shape) for k, v in _dmp().state_dict().items()}
