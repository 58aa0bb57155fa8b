"""A training step leaves nothing behind: outputs are freed by reference counting alone
(no cycles between cached awaitable results and autograd nodes), for every sharding type."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Dict

import torch
from ebc_cases import batch, make_ebc, plan_for
from multiprocess import run_ranks

from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan
from recshard.types import ShardingEnv

KINDS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "mixed"]


def freed_after_step(rank: int, ws: int) -> Dict[str, bool]:
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    reference = make_ebc(False)
    freed = {}
    gc.disable()
    try:
        for kind in KINDS:
            plan = construct_module_sharding_plan(
                reference, plan_for(kind, ws, ws, "fused"), world_size=ws
            )
            sharded = EmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
            out = sharded(batch(rank, 0, 3, False, False))
            values = out.values()
            # the output dists' awaitables cache their results: nothing may keep them alive
            watch = [weakref.ref(values)] + [weakref.ref(a) for a in out._pending]
            (values * 2).sum().backward()
            del out, values
            freed[kind] = all(w() is None for w in watch)
    finally:
        gc.enable()
    return freed


def test_outputs_are_freed_without_the_garbage_collector() -> None:
    for result in run_ranks(2, freed_after_step, timeout=120):
        assert all(result.values()), result
