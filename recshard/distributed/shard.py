"""TorchRec's `torchrec.distributed.shard`: shard one collection, or every collection of a
model, without wrapping it in DistributedModelParallel.

    sharded_ebc = shard(ebc, row_wise())                   # one plan helper for every table
    sharded_ebc = shard(ebc, {"t0": table_wise(rank=0), "t1": row_wise()})
    model = shard_modules(model, plan=plan)                # children replaced in place

`shard` returns the sharded module; `shard_modules` returns `module` with each collection the
plan names replaced by its sharded version (or the sharded module when `module` itself is one).
Neither wraps the dense rest in DDP: that is DistributedModelParallel's job.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from recshard.distributed.model_parallel import DistributedModelParallel, default_sharders
from recshard.plan.manual import ShardingGenerator, construct_module_sharding_plan
from recshard.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingEnv,
    ShardingPlan,
)

PlanLike = EmbeddingModuleShardingPlan | Dict[str, ParameterSharding | ShardingGenerator] | Callable


def _default_device() -> torch.device:
    """TorchRec's default: the current CUDA device when there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sharder_for(module: nn.Module, sharder: ModuleSharder | None) -> ModuleSharder:
    if sharder is not None:
        return sharder
    for candidate in default_sharders():
        if type(module) is candidate.module_type:
            return candidate
    raise ValueError(f"shard: no default sharder for {type(module).__name__}; pass sharder=")


def _fixed(sharding: ParameterSharding) -> ShardingGenerator:
    return lambda *args: sharding


def shard(
    module: nn.Module,
    plan: PlanLike,
    env: ShardingEnv | None = None,
    device: torch.device | None = None,
    sharder: ModuleSharder | None = None,
) -> nn.Module:
    """The sharded version of `module` (an EBC, EC or their quantized twins). `plan`: a
    `{table: ParameterSharding}` plan, `{table: ParameterSharding or plan helper}`, or one
    plan helper applied to every table. `env` defaults to the default process group, `device`
    to the current CUDA device (else CPU), `sharder` to the default one for the module type."""
    sharder = _sharder_for(module, sharder)
    env = env or ShardingEnv.from_process_group(dist.group.WORLD)
    device = torch.device(device) if device is not None else _default_device()
    if callable(plan):
        per_table = {name: plan for name in sharder.shardable_parameters(module)}
    else:
        per_table = {
            name: _fixed(s) if isinstance(s, ParameterSharding) else s for name, s in plan.items()
        }
    module_plan = construct_module_sharding_plan(
        module,
        per_table,
        sharder,
        local_size=env.local_world_size,
        world_size=env.world_size,
        device_type=device.type,
    )
    return sharder.shard(module, module_plan, env, device)


def shard_modules(
    module: nn.Module,
    env: ShardingEnv | None = None,
    device: torch.device | None = None,
    plan: ShardingPlan | None = None,
    sharders: List[ModuleSharder] | None = None,
    init_params: bool = False,
) -> nn.Module:
    """`module` with every collection the plan names replaced by its sharded version (the
    planner's collective plan when `plan` is None). `init_params`: materialize parameters
    left on `meta` outside the sharded modules on `device`."""
    device = torch.device(device) if device is not None else _default_device()
    sharded = DistributedModelParallel(
        module,
        env=env,
        device=device,
        plan=plan,
        sharders=sharders,
        init_data_parallel=False,
        init_parameters=init_params and device.type != "meta",
    )
    return sharded.module
