"""A DMP-wrapped model names its parameters, buffers and state as the unsharded model does,
on every rank, whether the collection is nested or is the root module DMP wraps; kernel
internals never show. The usual "dense parameters to Adam" setup then works on every rank."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recshard import ShardingPlan
from recshard.distributed import DistributedModelParallel
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.optim import KeyedOptimizerWrapper, in_backward_optimizer_filter
from tests.distributed.ebc_cases import make_ebc
from tests.distributed.ec_cases import make_ec
from tests.multiprocess import run_ranks


class Model(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.sparse = make_ebc(weighted=False) if kind == "ebc" else make_ec()
        self.dense = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(2))


def _plan() -> Dict[str, Any]:
    # t0 only on rank 1, t3 only on rank 0 (fused: fbgemm for dims 4/8, torch for 6)
    return {
        "t0": table_wise(rank=1),
        "t1": row_wise(),
        "t2": data_parallel(),
        "t3": table_wise(rank=0),
        "t4": column_wise(ranks=[0, 1]),
    }


def _names(rank: int, ws: int, kind: str, root: bool) -> Tuple[List[str], ...]:
    model = Model(kind)
    expected = (
        [n for n, _ in model.named_parameters()],
        [n for n, _ in model.named_buffers()],
        sorted(model.state_dict()),
    )
    if root:
        expected = tuple(
            [n[len("sparse.") :] for n in names if n.startswith("sparse.")] for names in expected
        )
    target = model.sparse if root else model
    shapes = {k: v.shape for k, v in model.sparse.state_dict().items()}  # before DMP shards it
    plan = ShardingPlan(
        {
            "" if root else "sparse": construct_module_sharding_plan(
                model.sparse, _plan(), world_size=ws
            )
        }
    )
    dmp = DistributedModelParallel(target, plan=plan)
    params = dict(dmp.named_parameters())
    got = (list(params), [n for n, _ in dmp.named_buffers()], sorted(dmp.state_dict()))
    # the named parameter is the live table: it aliases the state dict's local shard
    key = "sparse.embedding_bags.t3.weight" if kind == "ebc" else "sparse.embeddings.t3.weight"
    key = key[len("sparse.") :] if root else key
    if rank == 0:
        shard = dmp.state_dict()[key].local_shards()[0].tensor
        assert params[key].data_ptr() == shard.data_ptr() and params[key].shape == shard.shape
    else:
        assert params[key].numel() == 0
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=0.1))  # no empty list
    # the sharded module's own state, and a plain parent's, use the unsharded names too
    sharded = dmp.module if root else dmp.module.sparse
    own = (sorted(sharded.state_dict()), sorted(dmp.module.state_dict()))
    assert own == (sorted(shapes), expected[2])
    torch.manual_seed(1)  # the same full tables on every rank
    full = {k: torch.randn(shape) for k, shape in shapes.items()}
    sharded.load_state_dict(full)
    for key, value in sharded.state_dict().items():
        for shard in value.local_shards() if isinstance(value, ShardedTensor) else []:
            rows, cols = shard.metadata.shard_offsets
            height, width = shard.metadata.shard_sizes
            assert torch.equal(shard.tensor, full[key][rows : rows + height, cols : cols + width])
        if not isinstance(value, ShardedTensor):
            assert torch.equal(value, full[key]), key
    return expected, got, sorted(dense)


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("root", [False, True], ids=["nested", "root"])
def test_dmp_uses_unsharded_names(kind: str, root: bool) -> None:
    for rank, (expected, got, dense) in enumerate(run_ranks(2, _names, kind, root, timeout=180)):
        assert got == expected, f"rank {rank}"
        prefix = "" if root else "sparse."
        tables = "embedding_bags" if kind == "ebc" else "embeddings"
        # dense optimizer: the Linear (when nested) and the data-parallel table t2, nothing fused
        assert dense == sorted(
            ([] if root else ["dense.bias", "dense.weight"]) + [f"{prefix}{tables}.t2.weight"]
        ), f"rank {rank}"
