"""EC index dedup (`EmbeddingCollectionSharder(use_index_dedup=True)`, or TorchRec's global
`set_ec_index_dedup(True)`): each feature's distinct ids alone cross the all-to-alls, and the
sharded EC gives the same outputs (values, lengths, `need_indices` ids), the same tables after
two fused SGD steps and the same rejections as without it, in every sharding type, with
features read by several tables."""

from __future__ import annotations

import warnings
from typing import Dict, List

import pytest
import torch
from ec_cases import KEYS, batch, gather_tables, make_ec, output_grads, plan_for
from multiprocess import run_ranks

from recshard import KeyedJaggedTensor
from recshard.distributed.embedding import (
    EmbeddingCollectionSharder,
    get_ec_index_dedup,
    set_ec_index_dedup,
)
from recshard.distributed.sharding_plan import construct_module_sharding_plan
from recshard.types import ShardingEnv

LR = 0.1


def _sharded(kind: str, ws: int, shared: bool, need_indices: bool, dedup: bool | None):
    """`dedup` None: the sharder's default (the global switch decides)."""
    ec = make_ec(need_indices=need_indices, seed=3, shared=shared)
    plan = construct_module_sharding_plan(ec, plan_for(kind, ws, "fused", shared), world_size=ws)
    fused = {"optimizer": "exact_sgd", "learning_rate": LR}
    sharder = (
        EmbeddingCollectionSharder(fused_params=fused)
        if dedup is None
        else EmbeddingCollectionSharder(fused_params=fused, use_index_dedup=dedup)
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    return sharder.shard(ec, plan, env)


def _ids_sent(sharded, kjt: KeyedJaggedTensor) -> int:
    ctx = sharded.create_context()
    sharded.input_dist(ctx, kjt).wait().wait()
    return int(ctx.features.values().numel())


def compare(rank: int, ws: int) -> List[str]:
    problems = []
    for kind in ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"]:
        for shared, need_indices in [(False, True), (True, False)]:
            where = f"{kind}/shared={shared}"
            plain = _sharded(kind, ws, shared, need_indices, dedup=False)
            dedup = _sharded(kind, ws, shared, need_indices, dedup=True)
            for step in range(2):
                kjt = batch(rank, step, 6, zero_feature=step == 1, shared=shared)
                if not _ids_sent(dedup, kjt) < _ids_sent(plain, kjt):
                    problems.append(f"{where}: dedup sent no fewer ids")
                outs = [plain(kjt).wait(), dedup(kjt).wait()]
                if list(outs[0]) != list(outs[1]):
                    problems.append(f"{where}: keys {list(outs[0])} != {list(outs[1])}")
                for name, jt in outs[0].items():
                    other = outs[1][name]
                    # after a step: a duplicate id's gradients summed in another order
                    same = torch.allclose(jt.values(), other.values(), atol=1e-6)
                    same = same and torch.equal(jt.lengths(), other.lengths())
                    if need_indices:
                        same = same and torch.equal(jt.weights(), other.weights())
                    if not same:
                        problems.append(f"{where} step {step}: output '{name}' differs")
                grads = output_grads(step, rank, kjt, shared)
                for out in outs:
                    sum((out[n].values() * g).sum() for n, g in grads.items()).backward()
            tables = [gather_tables(m, ws) for m in (plain, dedup)]
            for name, weight in tables[0].items():
                if not torch.allclose(weight, tables[1][name], atol=1e-6):
                    problems.append(f"{where}: table {name} differs after two steps")
    return problems


@pytest.mark.parametrize("world_size", [1, 3])
def test_dedup_equals_no_dedup(world_size: int) -> None:
    for problems in run_ranks(world_size, compare, timeout=300):
        assert problems == []


def switch_and_reject(rank: int, ws: int) -> Dict[str, object]:
    """The global switch builds deduplicating collections; a bad id on rank 0 still stops
    every rank."""
    out: Dict[str, object] = {"default": get_ec_index_dedup()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_ec_index_dedup(True)
    out["warned"] = [str(w.message) for w in caught if w.category is DeprecationWarning]
    try:
        sharded = _sharded("row_wise", ws, False, False, dedup=None)
    finally:
        set_ec_index_dedup(False)
    kjt = batch(rank, 0, 6, zero_feature=False)
    out["dedup"] = _ids_sent(sharded, kjt) < kjt.values().numel()
    values = kjt.values().clone()
    if rank == 0:
        values[kjt.length_per_key()[0]] = 1000  # a bad id in the second key
    bad = KeyedJaggedTensor(KEYS, values, lengths=kjt.lengths())
    with pytest.raises((ValueError, RuntimeError)) as error:
        sharded(bad).wait()
    out["error"] = str(error.value)
    return out


def test_global_switch_and_rejection() -> None:
    for result in run_ranks(2, switch_and_reject, timeout=180):
        assert result["default"] is False
        assert result["warned"] and "use_index_dedup" in result["warned"][0]
        assert result["dedup"] is True
        assert "1000" in result["error"] and "'f3'" in result["error"]
