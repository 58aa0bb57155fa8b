"""Data-parallel tables under gradient accumulation equal the unsharded module.

Two forwards per step, with one backward of their summed loss or two separate backwards, an
evaluation forward (no grad) in between: the replicated tables' gradients must still be the
mean over ranks of each rank's summed gradient (DDP's rule), on every rank. Both ways of
averaging run: the plain all-reduce (these tables are small) and the exchange of the rows in
use only (forced with `ROW_EXCHANGE_MIN_BYTES = 0`).
"""

from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch
from ebc_cases import LR, batch, global_batch, make_ebc, output_grad
from multiprocess import run_ranks

from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
from recshard.sharding import data_parallel as data_parallel_sharding
from recshard.types import ShardingEnv

BATCH = 4
MODES = ["summed_loss", "separate_backwards", "eval_forward_between"]


def accumulate(rank: int, ws: int, mode: str, min_bytes: int) -> List[str]:
    data_parallel_sharding.ROW_EXCHANGE_MIN_BYTES = min_bytes
    reference = make_ebc(weighted=False)
    plan = construct_module_sharding_plan(
        reference, {n: data_parallel() for n in reference.embedding_bags}, world_size=ws
    )
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference),
        plan,
        ShardingEnv.from_process_group(torch.distributed.group.WORLD),
    )
    losses = []
    for micro in range(2):
        out = sharded(batch(rank, micro, BATCH, False, False))
        grad = output_grad(micro, ws, BATCH, out.values().size(1))[
            rank * BATCH : (rank + 1) * BATCH
        ]
        losses.append((out.values() * grad).sum())
        if mode == "separate_backwards":
            losses.pop().backward()
        if mode == "eval_forward_between" and micro == 0:
            with torch.no_grad():
                sharded(batch(rank, 5, BATCH, False, False))
    if losses:
        sum(losses).backward()
    for micro in range(2):  # reference: the global batches' loss, divided by ws (the mean)
        ref_out = reference(global_batch(ws, micro, BATCH, False, False))
        grad = output_grad(micro, ws, BATCH, ref_out.values().size(1))
        ((ref_out.values() * grad).sum() / ws).backward()
    problems = []
    mine: Dict[str, torch.Tensor] = {
        name: weight
        for name, shards in sharded.local_table_shards().items()
        for _, weight in shards
    }
    for name, bag in reference.embedding_bags.items():
        sharded_grad = mine[name].grad
        if sharded_grad is None or not torch.allclose(sharded_grad, bag.weight.grad, atol=1e-6):
            problems.append(f"{mode}/{min_bytes}: table {name} gradient differs")
    with torch.no_grad():  # and one SGD step keeps the replicas equal to the reference
        for name, bag in reference.embedding_bags.items():
            mine[name] -= LR * mine[name].grad
            bag.weight -= LR * bag.weight.grad
            if not torch.allclose(mine[name], bag.weight, atol=1e-6):
                problems.append(f"{mode}/{min_bytes}: table {name} after the step differs")
    return problems


def run_all(rank: int, ws: int) -> Dict[str, List[str]]:
    default = data_parallel_sharding.ROW_EXCHANGE_MIN_BYTES
    return {
        f"{mode}/{min_bytes}": accumulate(rank, ws, mode, min_bytes)
        for mode in MODES
        for min_bytes in (0, default)
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_data_parallel_gradient_accumulation(world_size: int) -> None:
    results = run_ranks(world_size, run_all, timeout=300)
    failures = {
        (rank, mode): p
        for rank, per_mode in enumerate(results)
        for mode, p in per_mode.items()
        if p
    }
    assert not failures, failures
