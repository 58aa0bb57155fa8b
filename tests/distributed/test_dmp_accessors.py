"""DMP's TorchRec-named accessors: `get_module` unwraps DMP only (DDP stays),
`get_unwrapped_module` strips both, `bare_named_parameters` leaves out fused tables,
`sparse_grad_parameter_names` lists only parameters with sparse gradients; `LazyNoWait`;
sharded collections implement the `ShardedTableState` protocol the state walk reads."""

from __future__ import annotations

from typing import Dict, List

import torch
from dmp_cases import TinyDLRM, batch_for, make_optimizer, train
from multiprocess import run_ranks
from torch.nn.parallel import DistributedDataParallel

from recshard.distributed import DistributedModelParallel, get_module, get_unwrapped_module
from recshard.distributed.sharded_state import ShardedTableState
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.types import LazyNoWait, ShardingPlan


def accessors(rank: int, ws: int) -> Dict[str, List[str]]:
    torch.manual_seed(0)
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                TinyDLRM("meta").ebc,
                {"ta": table_wise(0), "tb": table_wise(1), "tc": table_wise(0)},
                world_size=ws,
            )
        }
    )
    model = DistributedModelParallel(TinyDLRM(), plan=plan)
    loss = model(*batch_for(0, rank, ws))
    loss.backward()
    return {
        "get_module": [type(get_module(model)).__name__],
        "get_unwrapped_module": [type(get_unwrapped_module(model)).__name__],
        "plain": [type(get_module(model.module)).__name__],
        "bare": sorted(name for name, _ in model.bare_named_parameters()),
        "all": sorted(name for name, _ in model.named_parameters()),
        "sparse_grads": model.sparse_grad_parameter_names,
        "state_protocol": [str(isinstance(get_unwrapped_module(model).ebc, ShardedTableState))],
        "state_keys": sorted(k for k in model.state_dict() if k.startswith("ebc.")),
    }


def test_dmp_accessors_follow_torchrec() -> None:
    for result in run_ranks(2, accessors):
        assert result["get_module"] == [DistributedDataParallel.__name__]
        assert result["get_unwrapped_module"] == [TinyDLRM.__name__]
        assert result["plain"] == [TinyDLRM.__name__]
        assert result["bare"] == ["dense.bias", "dense.weight", "over.bias", "over.weight"]
        assert set(result["bare"]) < set(result["all"])
        assert result["sparse_grads"] == []
        assert result["state_protocol"] == ["True"]  # checkpoints read tables through it only
        assert result["state_keys"] == [
            f"ebc.embedding_bags.{t}.weight" for t in ("ta", "tb", "tc")
        ]


def test_lazy_no_wait_returns_its_value_and_acts_like_it() -> None:
    value = torch.tensor([1.0, 2.0])
    lazy = LazyNoWait(value)
    assert torch.equal(lazy + 1, torch.tensor([2.0, 3.0]))
    assert lazy.wait() is value


def copied(rank: int, ws: int) -> Dict[str, List[float]]:
    """Per kernel: the losses of `copy()`'s twin trained 2 steps, then of the original trained
    the same 2 steps from where it was (equal only if the twin is a true, working copy)."""
    losses: Dict[str, List[float]] = {}
    for kernel in ("fused", "dense"):
        k = None if kernel == "fused" else "dense"
        plan = ShardingPlan(
            {
                "ebc": construct_module_sharding_plan(
                    TinyDLRM("meta").ebc,
                    {
                        "ta": table_wise(ws - 1, compute_kernel=k),
                        "tb": row_wise(compute_kernel=k),
                        "tc": data_parallel(),
                    },
                    world_size=ws,
                )
            }
        )
        torch.manual_seed(0)
        original = DistributedModelParallel(TinyDLRM(), plan=plan)
        twin = original.copy(torch.device("cpu"))
        fused = kernel == "fused"
        losses[f"{kernel}/twin"] = train(
            twin, make_optimizer(twin, fused, False), range(2), rank, ws
        )
        losses[f"{kernel}/original"] = train(
            original, make_optimizer(original, fused, False), range(2), rank, ws
        )
    return losses


def test_copy_of_a_model_with_data_parallel_tables_trains_on_its_own() -> None:
    # a data-parallel table keeps its ShardingEnv, whose process group cannot be deep-copied:
    # the copy shares the group
    for result in run_ranks(2, copied):
        for kernel in ("fused", "dense"):
            torch.testing.assert_close(
                torch.tensor(result[f"{kernel}/twin"]),
                torch.tensor(result[f"{kernel}/original"]),
                msg=kernel,
            )


def copy_devices(rank: int, ws: int) -> Dict[str, List[str]]:
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                TinyDLRM("meta").ebc,
                {"ta": table_wise(0), "tb": row_wise(), "tc": data_parallel()},
                world_size=ws,
            )
        }
    )
    model = DistributedModelParallel(TinyDLRM(), plan=plan)
    twin = model.copy(torch.device("meta"))
    placed: Dict[str, List[str]] = {}
    for name, p in twin.named_parameters():
        placed.setdefault(p.device.type, []).append(name)
    return placed


def test_copy_moves_the_unsharded_parts_and_leaves_the_shards() -> None:
    (placed,) = run_ranks(1, copy_devices)
    assert sorted(placed["meta"]) == ["dense.bias", "dense.weight", "over.bias", "over.weight"]
    assert sorted(placed["cpu"]) == [f"ebc.embedding_bags.{t}.weight" for t in ("ta", "tb", "tc")]
