"""Manual sharding plans: per-table helpers, as TorchRec's `construct_module_sharding_plan`.

    plan = construct_module_sharding_plan(ebc, {
        "t0": table_wise(rank=1),
        "t1": row_wise(),
        "t2": column_wise(ranks=[0, 1]),
        "t3": data_parallel(),
    }, world_size=2)

Each helper returns a generator that, given the table and the topology, builds a mutable
`ParameterSharding` with ranks and shard metadata (offsets, sizes, placement).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch.distributed as dist
from torch import nn

from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.plan.geometry import make_shards
from recshard.plan.validate import check_table_plan
from recshard.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
    get_local_size,
)

ShardingGenerator = Callable[[BaseEmbeddingConfig, int, int, str], ParameterSharding]


def _kernel(compute_kernel: Optional[str], default: EmbeddingComputeKernel) -> str:
    kernel = EmbeddingComputeKernel(compute_kernel) if compute_kernel else default
    return kernel.value


def _generator(sharding_type: ShardingType, ranks_fn: Callable[[int, int], List[int]],
               compute_kernel: Optional[str]) -> ShardingGenerator:
    default = (EmbeddingComputeKernel.DENSE if sharding_type == ShardingType.DATA_PARALLEL
               else EmbeddingComputeKernel.FUSED)

    def generate(config: BaseEmbeddingConfig, local_size: int, world_size: int,
                 device_type: str) -> ParameterSharding:
        ranks = ranks_fn(local_size, world_size)
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"table '{config.name}': ranks {bad} are outside world size {world_size}")
        shards = make_shards(sharding_type.value, config.num_embeddings, config.embedding_dim,
                             ranks, device_type)
        return ParameterSharding(sharding_type.value, _kernel(compute_kernel, default),
                                 None if sharding_type == ShardingType.DATA_PARALLEL else ranks,
                                 shards)

    return generate


def data_parallel(compute_kernel: Optional[str] = None) -> ShardingGenerator:
    return _generator(ShardingType.DATA_PARALLEL, lambda lws, ws: list(range(ws)), compute_kernel)


def table_wise(rank: int, compute_kernel: Optional[str] = None) -> ShardingGenerator:
    return _generator(ShardingType.TABLE_WISE, lambda lws, ws: [rank], compute_kernel)


def row_wise(compute_kernel: Optional[str] = None) -> ShardingGenerator:
    return _generator(ShardingType.ROW_WISE, lambda lws, ws: list(range(ws)), compute_kernel)


def column_wise(ranks: List[int], compute_kernel: Optional[str] = None) -> ShardingGenerator:
    """One column shard per listed rank (a rank may be listed twice), widths as even as possible."""
    return _generator(ShardingType.COLUMN_WISE, lambda lws, ws: list(ranks), compute_kernel)


def table_row_wise(host_index: int, compute_kernel: Optional[str] = None) -> ShardingGenerator:
    """Rows split over every rank of node `host_index`."""
    return _generator(ShardingType.TABLE_ROW_WISE,
                      lambda lws, ws: [host_index * lws + i for i in range(lws)], compute_kernel)


def table_column_wise(host_index: int, ranks: Optional[List[int]] = None,
                      compute_kernel: Optional[str] = None) -> ShardingGenerator:
    """Column shards on ranks of node `host_index` (local ranks `ranks`, default all of them)."""
    def ranks_fn(lws: int, ws: int) -> List[int]:
        local = list(range(lws)) if ranks is None else ranks
        bad = [r for r in local if not 0 <= r < lws]
        if bad:
            raise ValueError(f"table_column_wise: local ranks {bad} outside local size {lws}")
        return [host_index * lws + r for r in local]

    return _generator(ShardingType.TABLE_COLUMN_WISE, ranks_fn, compute_kernel)


def module_table_configs(module: nn.Module) -> List[BaseEmbeddingConfig]:
    for getter in ("embedding_bag_configs", "embedding_configs"):
        if hasattr(module, getter):
            return list(getattr(module, getter)())
    raise ValueError(f"{type(module).__name__} is not a shardable embedding collection")


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Dict[str, ShardingGenerator],
    local_size: Optional[int] = None,
    world_size: Optional[int] = None,
    device_type: Optional[str] = None,
) -> EmbeddingModuleShardingPlan:
    """A plan for one collection: `{table: ParameterSharding}` from per-table helpers."""
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    local_size = local_size or get_local_size(world_size)
    configs = {c.name: c for c in module_table_configs(module)}
    unknown = [t for t in per_param_sharding if t not in configs]
    if unknown:
        raise ValueError(f"construct_module_sharding_plan: tables {unknown} are not in the module "
                         f"(its tables: {list(configs)})")
    plan = {
        name: generate(configs[name], local_size, world_size, device_type or "cpu")
        for name, generate in per_param_sharding.items()
    }
    for name, ps in plan.items():
        check_table_plan(configs[name], ps, world_size, local_size)
    return plan
