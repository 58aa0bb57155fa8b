"""A sharded collection under its unsharded names: each table's local weight as the parameter
`embedding_bags.<t>.weight` (the module's `table_key`, as `table_state.shard_fqn` names it),
and the in-backward optimizer of its fused tables keyed the same way, its state laid out like
the tables."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from recshard.distributed.sharded_state import ShardedTableState, fused_state
from recshard.distributed.table_state import Shards, shard_fqn
from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.optim.clipping import mark_sharded
from recshard.optim.fused import FusedOptimizer
from recshard.sharding.common import EmbeddingSharding
from recshard.types import EmbeddingComputeKernel, EmbeddingModuleShardingPlan, ShardingType


def _is_fused(table_plans: EmbeddingModuleShardingPlan, table: str) -> bool:
    return table_plans[table].compute_kernel != EmbeddingComputeKernel.DENSE.value


def unsharded_parameters(
    table_key: Callable[[str], str],
    configs: List[BaseEmbeddingConfig],
    table_plans: EmbeddingModuleShardingPlan,
    shards: Shards,
    device: torch.device,
    pg: dist.ProcessGroup | None,
) -> Dict[str, nn.Parameter]:
    """Each table's local weight by unsharded name, never the kernels' storage. A table with no
    shard here gives an empty parameter (as TorchRec); fused tables are marked
    `_in_backward_optimizers`."""
    out: Dict[str, nn.Parameter] = {}
    for config in configs:
        local = shards.get(config.name, [])
        plan = table_plans[config.name]
        fused = _is_fused(table_plans, config.name)
        # a dense model-parallel table's pieces (and the empty stand-in of a rank without
        # one: every rank then joins the same all-reduce) add up in a clipping norm
        cut = not fused and plan.sharding_type != ShardingType.DATA_PARALLEL.value
        if not local:
            local_param = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
            local_param._in_backward_optimizers = fused
            if cut:
                mark_sharded(local_param, pg)
            out[table_key(config.name)] = local_param
        for table, weight in local:
            if not isinstance(weight, nn.Parameter):  # fused storage: an alias, no grad
                weight = nn.Parameter(weight.detach(), requires_grad=False)
                weight._in_backward_optimizers = True
            elif cut:
                mark_sharded(weight, pg)
            out[shard_fqn(table_key(config.name), table, len(local))] = weight
    return out


def fused_optimizer(
    module: ShardedTableState,
    shardings: List[EmbeddingSharding],
    configs: List[BaseEmbeddingConfig],
    table_plans: EmbeddingModuleShardingPlan,
) -> FusedOptimizer:
    """The in-backward optimizer of `module`'s fused tables, keyed by table FQN."""
    counts = {name: len(shards) for name, shards in module.local_table_shards().items()}
    kernels, names = [], []
    for sharding in shardings:
        for kernel in sharding.lookup.kernels:
            if kernel.is_fused:
                kernels.append(kernel)
                names.append(
                    [shard_fqn(module.table_key(t.name), t, counts[t.name]) for t in kernel.tables]
                )

    def sharded_state() -> Dict[str, Dict[str, Any]]:
        """`{table fqn: {state name: ShardedTensor}}`: the fused state laid out like its table
        (views of the live state), for the fused optimizer's `state_dict()`."""
        nested: Dict[str, Dict[str, Any]] = {  # every fused table, on every rank (SGD: {})
            module.table_key(c.name): {} for c in configs if _is_fused(table_plans, c.name)
        }
        for key, value in fused_state(module, "").items():
            fqn, _, name = key.rpartition(".")  # state names have no dots
            nested[fqn][name] = value
        return nested

    dims = {module.table_key(c.name): c.embedding_dim for c in configs}
    table_names = {module.table_key(c.name): c.name for c in configs}
    return FusedOptimizer(kernels, names, sharded_state, dims, table_names)
