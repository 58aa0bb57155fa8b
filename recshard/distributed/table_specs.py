"""Each table of a sharded collection as its shardings are built from it (`TableSpec`): its
plan entry and its fused params, parsed once (`FusedParams`) from TorchRec's `fused_params`
dict, the sharder's, overridden by the optimizer attached to the table's unsharded weight
(`apply_optimizer_in_backward`) and by the plan's cache load factor. Checked here, on every
rank and before any collective, that each table's kernel runs its optimizer and that every
rank's storage can hold its key-value shards.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from recshard.lookup.fused_params import FusedParams, check_backend
from recshard.lookup.grouped import uses_fbgemm
from recshard.lookup.key_value import check_storage
from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.optim.apply_optimizer_in_backward import fused_params_for
from recshard.sharding.common import TableSpec
from recshard.types import EmbeddingComputeKernel, EmbeddingModuleShardingPlan, ShardingEnv


def table_specs(
    tables: nn.ModuleDict,
    configs: List[BaseEmbeddingConfig],
    table_plans: EmbeddingModuleShardingPlan,
    fused_params: Dict[str, Any] | None,
    env: ShardingEnv,
    device: torch.device,
    is_weighted: bool,
) -> List[TableSpec]:
    """Each table (of the unsharded module's `tables`) with its parsed fused params. A
    dense-kernel table ignores the attached optimizer and the fused params, as in TorchRec:
    its weight is a plain parameter that `in_backward_optimizer_filter` yields to the dense
    optimizer."""
    specs = []
    for c in configs:
        plan = table_plans[c.name]
        if plan.compute_kernel == EmbeddingComputeKernel.DENSE.value:
            specs.append(TableSpec(c, plan))
            continue
        merged = fused_params_for(tables[c.name].weight, fused_params, c.name)
        if plan.cache_params is not None and plan.cache_params.load_factor is not None:
            merged["cache_load_factor"] = plan.cache_params.load_factor  # the plan's wins
        spec = TableSpec(c, plan, FusedParams.parse(merged, c.name))
        fbgemm_on_cuda = device.type == "cuda" and uses_fbgemm(spec.local_table(0), is_weighted)
        check_backend(spec.fused_params.optim, c.name, fbgemm_on_cuda)
        specs.append(spec)
    _check_key_value_storage(specs, env)
    return specs


def _check_key_value_storage(specs: List[TableSpec], env: ShardingEnv) -> None:
    """Every rank raises if any rank's storage cannot hold its key_value shards (one gather of
    the verdicts, only when the plan has key_value tables)."""
    key_value = [s for s in specs if s.kernel == EmbeddingComputeKernel.KEY_VALUE]
    if not key_value:
        return
    mine = [
        spec.local_table(i)
        for spec in key_value
        for i, shard in enumerate(spec.shards())
        if shard.rank == env.rank
    ]
    verdict = ""
    try:
        check_storage(mine, [t.fused_params.optim for t in mine])
    except ValueError as e:
        verdict = str(e)
    verdicts = [verdict]
    if env.pg is not None and env.world_size > 1:
        verdicts = [""] * env.world_size
        dist.all_gather_object(verdicts, verdict, group=env.pg)
    for rank, text in enumerate(verdicts):
        if text:
            raise ValueError(f"rank {rank}: {text}")
