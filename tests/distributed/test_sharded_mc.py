"""Sharded managed collision (row-wise, bucket-aligned shards) equals the unsharded module with
the same buckets, step for step, with evictions: outputs, the ids holding each row, weights.

Reference: the unsharded model trained in one process on the concatenated global batches
(SGD, loss divided by the world size: the sharded gradient convention)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from mc_cases import KEYS, LR, SequenceModel, SparseModel, kjt_of, local_ids
from multiprocess import run_ranks

from recshard.distributed import DistributedModelParallel
from recshard.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from recshard.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recshard.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recshard.types import ShardingPlan

STEPS = 12


def _sharder(optimizer: str = "exact_sgd") -> ManagedCollisionEmbeddingBagCollectionSharder:
    return ManagedCollisionEmbeddingBagCollectionSharder(
        fused_params={"optimizer": optimizer, "learning_rate": LR}
    )


def _sharded(dmp: DistributedModelParallel) -> BaseShardedManagedCollisionEmbeddingCollection:
    return next(
        m for m in dmp.modules() if isinstance(m, BaseShardedManagedCollisionEmbeddingCollection)
    )


def _compare(
    rank: int,
    ws: int,
    model_buckets: int,
    ref_buckets: int,
    use_planner: bool,
    lru: bool,
    per_table: Dict[str, Any] | None = None,
    remapped: bool = True,
) -> List[str]:
    """`remapped`: check the returned remapped features (not offered with column-split
    tables)."""
    reference = SparseModel(ref_buckets, lru, return_remapped=remapped)
    model = SparseModel(model_buckets, lru, return_remapped=remapped)
    sharder = _sharder()
    plan = None
    if not use_planner:
        per_table = per_table or {"t0": row_wise(), "t1": row_wise()}
        module_plan = construct_module_sharding_plan(
            model.sparse, per_table, sharder=sharder, world_size=ws
        )
        plan = ShardingPlan({"sparse": module_plan})
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    sharded = _sharded(dmp)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    problems: List[str] = []
    evictions = 0
    for step in range(STEPS):
        parts = [local_ids(step, r) for r in range(ws)]
        out = dmp(kjt_of([parts[rank]]))
        out.sum().backward()
        ref_out = reference(kjt_of(parts))
        ref_opt.zero_grad()
        (ref_out.sum() / ws).backward()
        ref_opt.step()
        want = ref_out.detach()[rank * 4 : (rank + 1) * 4]
        if not torch.allclose(out.detach(), want, atol=1e-5):
            problems.append(f"step {step}: outputs differ by {(out - want).abs().max():.3g}")
        for f in KEYS if remapped else []:
            assert model.remapped is not None and reference.remapped is not None
            before = sum(len(bag) for r in range(rank) for bag in parts[r][f])
            mine = model.remapped[f].values()
            if not torch.equal(
                mine, reference.remapped[f].values()[before : before + mine.numel()]
            ):
                problems.append(f"step {step}, feature {f}: remapped rows differ")
        ref_mcc = reference.sparse._managed_collision_collection.modules_by_table()
        for table, local in sharded._managed_collision_collection.local_modules().items():
            lo, hi = local.row_range()
            if not torch.equal(local._mch_raw_ids, ref_mcc[table]._mch_raw_ids[lo:hi]):
                problems.append(f"step {step}: table {table} rows {lo}:{hi} hold other ids")
            evictions += int(ref_mcc[table]._mch_raw_ids.ne(torch.iinfo(torch.int64).max).sum())
    weights = sharded._embedding_module.local_table_shards()
    for table, shards in weights.items():
        for local_table, weight in shards:
            ref = reference.sparse._embedding_module.embedding_bags[table].weight.detach()
            rows = slice(local_table.row_offset, local_table.row_offset + local_table.rows)
            block = ref[rows, local_table.col_offset : local_table.col_offset + local_table.cols]
            if not torch.allclose(weight, block, atol=1e-5):
                problems.append(f"table {table}: weights differ by {(weight - block).abs().max()}")
    if evictions == 0:
        problems.append("no id ever got a row: the test exercised nothing")
    return problems


@pytest.mark.parametrize("ws, remap", [(1, "native"), (2, "native"), (3, "native"), (2, "torch")])
def test_sharded_equals_unsharded_with_evictions(ws: int, remap: str) -> None:
    """6 buckets serve 1, 2 and 3 ranks; zch sizes 23 and 17 are multiples of none; one
    table LFU every 2 steps, one DistanceLFU every step (MEAN pooled); then LRU, the plan from
    the planner, TorchRec's default buckets=1 (rebuilt with one bucket per rank), and
    table-wise / table-row-wise tables beside row-wise ones. `remap`: the C++ id index,
    remap and routing (where built) or the torch ops (`RECSHARD_NATIVE_MC=0`)."""
    env = {"RECSHARD_NATIVE_MC": "0"} if remap == "torch" else None
    results = run_ranks(ws, _cases, timeout=240, env=env)
    for rank, found in enumerate(results):
        for case, problems in found.items():
            assert not problems, f"rank {rank}, {case}: {problems}"


def _cases(rank: int, ws: int) -> dict:
    return {
        "manual plan": _compare(rank, ws, 6, 6, False, False),
        "planner, LRU": _compare(rank, ws, 6, 6, True, True),
        "buckets=1": _compare(rank, ws, 1, ws, False, False),
        "table-wise and row-wise": _compare(
            rank, ws, 6, 6, False, False, {"t0": table_wise(ws - 1), "t1": row_wise()}
        ),
        "table-wise, table-row-wise": _compare(
            rank, ws, 6, 6, False, True, {"t0": table_row_wise(0), "t1": table_wise(0)}
        ),
        **_column_cases(rank, ws),
    }


def _column_cases(rank: int, ws: int) -> dict:
    """t0 column-wise (two shards on the last rank at ws 1-2: one replica counts once);
    t1 table-column-wise beside a row-wise or column-wise t0; buckets=1 kept (a replica
    holds every bucket)."""
    return {
        "column-wise and row-wise": _compare(
            rank, ws, 6, 6, False, False, {"t0": column_wise([0, ws - 1]), "t1": row_wise()}, False
        ),
        "column-wise, table-column-wise, buckets=1": _compare(
            rank,
            ws,
            1,
            1,
            False,
            True,
            {"t0": column_wise([ws - 1, 0, ws - 1]), "t1": table_column_wise(0)},
            False,
        ),
    }


def _compare_sequence(rank: int, ws: int, placed: str) -> List[str]:
    """Rows per id and the remapped features (this rank's ids' table rows) as unsharded; the
    planner's plan, or ("tw") t0 table-wise on the last rank and t1 table-row-wise, or ("cw")
    both column-wise (remapped features not offered there)."""
    remapped = placed != "cw"
    reference, model = SequenceModel(6, remapped), SequenceModel(6, remapped)
    sharder = ManagedCollisionEmbeddingCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LR}
    )
    plan = None
    if placed:
        per_table = {"t0": table_wise(ws - 1), "t1": table_row_wise(0)}
        if placed == "cw":  # (an EmbeddingCollection has no table-column-wise)
            per_table = {"t0": column_wise([0, ws - 1]), "t1": column_wise([ws - 1])}
        module_plan = construct_module_sharding_plan(
            model.sparse, per_table, sharder=sharder, world_size=ws
        )
        plan = ShardingPlan({"sparse": module_plan})
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    problems: List[str] = []
    for step in range(STEPS):
        parts = [local_ids(step, r) for r in range(ws)]
        out = dmp(kjt_of([parts[rank]]))
        sum(v.sum() for v in out.values()).backward()
        ref_out = reference(kjt_of(parts))
        ref_opt.zero_grad()
        (sum(v.sum() for v in ref_out.values()) / ws).backward()
        ref_opt.step()
        for f, values in out.items():
            before = sum(len(bag) for r in range(rank) for bag in parts[r][f])
            want = ref_out[f].detach()[before : before + values.size(0)]
            if values.shape != want.shape or not torch.allclose(values.detach(), want, atol=1e-5):
                problems.append(f"step {step}, feature {f}: rows differ")
            if not remapped:
                continue
            remapped_kjt, ref_remapped = model.remapped, reference.remapped
            assert remapped_kjt is not None and ref_remapped is not None
            want_rows = ref_remapped[f].values()[before : before + values.size(0)]
            if not torch.equal(remapped_kjt[f].values(), want_rows):
                problems.append(f"step {step}, feature {f}: remapped rows differ")
            want_lengths = ref_remapped[f].lengths()[rank * 4 : (rank + 1) * 4]
            if not torch.equal(remapped_kjt[f].lengths(), want_lengths):
                problems.append(f"step {step}, feature {f}: remapped lengths differ")
        if remapped and model.remapped.keys() != reference.remapped.keys():  # type: ignore
            problems.append("remapped keys differ")
    mcc = reference.sparse._managed_collision_collection.modules_by_table()
    if not all(m.rows_in_use() > 0 for m in mcc.values()):
        problems.append("a table never gave an id a row: the test exercised nothing")
    return problems


@pytest.mark.parametrize("placed", ["", "tw", "cw"])
@pytest.mark.parametrize("ws", [1, 2, 3])
def test_sharded_mc_ec_equals_unsharded(ws: int, placed: str) -> None:
    for rank, problems in enumerate(run_ranks(ws, _compare_sequence, placed, timeout=180)):
        assert not problems, f"rank {rank}: {problems}"


def _bad_batch(rank: int, ws: int, placed: str) -> str:
    model, sharder, plan = SparseModel(6), _sharder(), None
    if placed:  # t1, where the bad id is, lives on rank 0 only, or column-wise on both
        per_table = {"t0": table_row_wise(0), "t1": table_wise(0)}
        if placed == "cw":
            per_table["t1"] = column_wise([0, 1])
        plan = ShardingPlan(
            {
                "sparse": construct_module_sharding_plan(
                    model.sparse, per_table, sharder=sharder, world_size=ws
                )
            }
        )
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    parts = local_ids(0, rank)
    if rank == ws - 1:
        parts["c"][1] = [-5]
    try:
        dmp(kjt_of([parts]))
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "placed, remap", [("", "native"), ("tw", "native"), ("cw", "native"), ("", "torch")]
)
def test_a_bad_id_on_one_rank_stops_every_rank(placed: str, remap: str) -> None:
    env = {"RECSHARD_NATIVE_MC": "0"} if remap == "torch" else None
    messages = run_ranks(2, _bad_batch, placed, timeout=120, env=env)
    assert messages[1].startswith("ValueError: table 't1', feature 'c': id -5 is outside [0, ")
    assert messages[0].startswith("RuntimeError: rank 1 rejected its input: table 't1'")


def _fused_state_reset(rank: int, ws: int) -> List[str]:
    """Rows whose id changed in a step hold zero row-wise Adagrad state after it (before the
    backward), and some of them held state before (row-wise: every rank holds rows of t1)."""
    model, sharder = SparseModel(6), _sharder("exact_row_wise_adagrad")
    per_table = {"t0": row_wise(), "t1": row_wise()}
    module_plan = construct_module_sharding_plan(
        model.sparse, per_table, sharder=sharder, world_size=ws
    )
    dmp = DistributedModelParallel(
        model, plan=ShardingPlan({"sparse": module_plan}), sharders=[sharder]
    )
    sharded = _sharded(dmp)
    local = sharded._managed_collision_collection.local_modules()["t1"]
    for step in range(6):
        dmp(kjt_of([local_ids(step, rank)])).sum().backward()
    ((_, state),) = sharded._embedding_module.fused_optimizer_states()["t1"]
    (momentum,) = state.values()
    before_ids, before_state = local._mch_raw_ids.clone(), momentum.clone()
    fresh = local_ids(100, rank)
    fresh["c"] = [[(1 << 30) + 6 * k + j for j in range(6)] for k in range(4)]  # new ids
    dmp(kjt_of([fresh]))
    changed = (local._mch_raw_ids != before_ids).nonzero().squeeze(1)
    problems = []
    if changed.numel() == 0 or not bool((before_state[changed] != 0).any()):
        problems.append(f"no trained row was evicted (changed rows {changed.tolist()})")
    if bool((momentum[changed] != 0).any()):
        problems.append(f"evicted rows kept their state: {momentum[changed].tolist()}")
    kept = (local._mch_raw_ids == before_ids).nonzero().squeeze(1)
    if not torch.equal(momentum[kept], before_state[kept]):
        problems.append("rows that kept their ids lost their state")
    return problems


def test_eviction_zeroes_fused_optimizer_state() -> None:
    for rank, problems in enumerate(run_ranks(2, _fused_state_reset, timeout=120)):
        assert not problems, f"rank {rank}: {problems}"


def _column_only(rank: int, ws: int) -> List[str]:
    return _compare(
        rank,
        ws,
        6,
        6,
        False,
        True,
        {"t0": column_wise([0, ws - 1]), "t1": table_column_wise(0)},
        False,
    )


def test_column_wise_alone_equals_unsharded() -> None:
    """Only column-split tables: no bucket routing, the placed sharding's own all-to-all."""
    for rank, problems in enumerate(run_ranks(2, _column_only, timeout=180)):
        assert not problems, f"rank {rank}: {problems}"
