"""Manual sharding plans: per-table helpers, as TorchRec's `construct_module_sharding_plan`.

    plan = construct_module_sharding_plan(ebc, {
        "t0": table_wise(1),
        "t1": row_wise(),
        "t2": column_wise([0, 1]),
        "t3": data_parallel(),
    }, EmbeddingBagCollectionSharder(), world_size=2, device_type="cpu")

The helpers take TorchRec's signatures and positional order (`table_wise(rank, device,
compute_kernel)`, `row_wise(sizes_placement, compute_kernel, num_buckets)`,
`column_wise(ranks, size_per_rank, compute_kernel, device_types)`); recshard's additions
(`compute_kernel` of `data_parallel` and `table_row_wise`) are keyword-only, and
`table_column_wise` is recshard's own. An argument recshard cannot honour (another device
than the plan's, uneven row or column sizes, buckets) is an error, never ignored.

Each helper returns a generator that, given the table, the topology and the sharder, builds a
mutable `ParameterSharding` with ranks and shard metadata (offsets, sizes, placement). The
sharder (any `recshard.types.ModuleSharder`) decides which module types, sharding types and
compute kernels are allowed, and the default kernel (fused, else dense, else quant; dense for
data-parallel), as TorchRec's does. Without one, the module's own tables are used and the
kernel defaults to fused (dense for data-parallel).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch.distributed as dist
from torch import nn

from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.plan.geometry import make_shards
from recshard.plan.module_tables import embedding_tables
from recshard.plan.sharding_types import ALL_SHARDING_TYPES, opt_in_compute_kernels
from recshard.plan.validate import check_table_plan
from recshard.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingType,
    get_local_size,
)

ShardingGenerator = Callable[
    [BaseEmbeddingConfig, int, int, str, ModuleSharder | None], ParameterSharding
]
ParameterShardingGenerator = ShardingGenerator  # TorchRec's name

# default kernel: the first of these the sharder offers (TorchRec's order of preference)
_KERNEL_PREFERENCE = {
    True: [EmbeddingComputeKernel.DENSE, EmbeddingComputeKernel.QUANT],  # data-parallel
    False: [
        EmbeddingComputeKernel.FUSED,
        EmbeddingComputeKernel.DENSE,
        EmbeddingComputeKernel.QUANT,
    ],
}


def _default_kernel(
    config: BaseEmbeddingConfig,
    sharding_type: ShardingType,
    device_type: str,
    sharder: ModuleSharder | None,
) -> str:
    preference = _KERNEL_PREFERENCE[sharding_type == ShardingType.DATA_PARALLEL]
    if sharder is None:
        return preference[0].value
    offered = sharder.compute_kernels(sharding_type.value, device_type)
    for kernel in preference:
        if kernel.value in offered:
            return kernel.value
    raise ValueError(
        f"table '{config.name}': {type(sharder).__name__} offers no default compute "
        f"kernel for {sharding_type.value} on {device_type} (offers {offered})"
    )


def _runnable_kernels(sharder: ModuleSharder, ps: ParameterSharding, device_type: str) -> List[str]:
    """What `sharder` runs for `ps`'s type: what it offers, plus the opt-in kernels of float
    (fused) sharders."""
    offered = list(sharder.compute_kernels(str(ps.sharding_type), device_type))
    if EmbeddingComputeKernel.FUSED.value in offered:
        offered += opt_in_compute_kernels(str(ps.sharding_type), device_type)
    return offered


def _check_devices(config: BaseEmbeddingConfig, devices: Sequence[str], device_type: str) -> None:
    other = sorted({d for d in devices if d != device_type})
    if other:
        raise ValueError(
            f"table '{config.name}': shard device {other} differs from the plan's "
            f"device_type '{device_type}'; recshard places every shard on the plan's "
            "device type (pass device_type to construct_module_sharding_plan)"
        )


def _generator(
    sharding_type: ShardingType,
    ranks_fn: Callable[[int, int], List[int]],
    compute_kernel: str | None,
    devices: Sequence[str] | None = None,
) -> ShardingGenerator:
    if compute_kernel is not None:
        EmbeddingComputeKernel(compute_kernel)  # an unknown kernel fails where it is written

    def generate(
        config: BaseEmbeddingConfig,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder | None = None,
    ) -> ParameterSharding:
        ranks = ranks_fn(local_size, world_size)
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ValueError(
                f"table '{config.name}': ranks {bad} are outside world size {world_size}"
            )
        if devices is not None:
            if len(devices) != len(ranks):
                raise ValueError(
                    f"table '{config.name}': {len(devices)} device types for {len(ranks)} shards"
                )
            _check_devices(config, devices, device_type)
        shards = make_shards(
            sharding_type.value, config.num_embeddings, config.embedding_dim, ranks, device_type
        )
        kernel = compute_kernel or _default_kernel(config, sharding_type, device_type, sharder)
        return ParameterSharding(
            sharding_type.value,
            kernel,
            None if sharding_type == ShardingType.DATA_PARALLEL else ranks,
            shards,
        )

    return generate


def _unsupported(helper: str, argument: str, why: str) -> ValueError:
    return ValueError(f"{helper}: {argument} is not supported by recshard ({why})")


def data_parallel(*, compute_kernel: str | None = None) -> ShardingGenerator:
    """Every rank holds the whole table (`compute_kernel` is recshard's, keyword-only)."""
    return _generator(ShardingType.DATA_PARALLEL, lambda lws, ws: list(range(ws)), compute_kernel)


def table_wise(
    rank: int, device: str | None = None, compute_kernel: str | None = None
) -> ShardingGenerator:
    """The whole table on `rank`; `device`, when given, must be the plan's device type."""
    return _generator(
        ShardingType.TABLE_WISE,
        lambda lws, ws: [rank],
        compute_kernel,
        None if device is None else [device],
    )


def row_wise(
    sizes_placement: Tuple[List[int], str | List[str]] | None = None,
    compute_kernel: str | None = None,
    num_buckets: int | None = None,
) -> ShardingGenerator:
    """Rows in equal blocks over every rank (the last ranks may hold fewer or none)."""
    if sizes_placement is not None:
        raise _unsupported(
            "row_wise",
            f"sizes_placement={sizes_placement!r}",
            "row-wise shards are equal blocks of ceil(rows / world_size) rows",
        )
    if num_buckets is not None:
        raise _unsupported("row_wise", f"num_buckets={num_buckets}", "no bucketized row-wise")
    return _generator(ShardingType.ROW_WISE, lambda lws, ws: list(range(ws)), compute_kernel)


def column_wise(
    ranks: List[int] | None = None,
    size_per_rank: List[int] | None = None,
    compute_kernel: str | None = None,
    device_types: List[str] | None = None,
) -> ShardingGenerator:
    """One column shard per listed rank (a rank may be listed twice), widths as even as possible
    (TorchRec requires the dim to divide evenly; recshard lets widths differ by one)."""
    if size_per_rank is not None:
        raise _unsupported(
            "column_wise",
            f"size_per_rank={size_per_rank}",
            "column widths are split evenly over `ranks`",
        )
    if ranks is None:
        raise ValueError("column_wise: pass `ranks`, the rank of each column shard")
    chosen = list(ranks)
    return _generator(
        ShardingType.COLUMN_WISE, lambda lws, ws: chosen, compute_kernel, device_types
    )


def table_row_wise(host_index: int, *, compute_kernel: str | None = None) -> ShardingGenerator:
    """Rows split over every rank of node `host_index` (`compute_kernel` is recshard's)."""
    return _generator(
        ShardingType.TABLE_ROW_WISE,
        lambda lws, ws: [host_index * lws + i for i in range(lws)],
        compute_kernel,
    )


def table_column_wise(
    host_index: int, ranks: List[int] | None = None, compute_kernel: str | None = None
) -> ShardingGenerator:
    """Column shards on ranks of node `host_index` (local ranks `ranks`, default all of them);
    recshard's own helper (TorchRec has none)."""

    def ranks_fn(lws: int, ws: int) -> List[int]:
        local = list(range(lws)) if ranks is None else ranks
        bad = [r for r in local if not 0 <= r < lws]
        if bad:
            raise ValueError(f"table_column_wise: local ranks {bad} outside local size {lws}")
        return [host_index * lws + r for r in local]

    return _generator(ShardingType.TABLE_COLUMN_WISE, ranks_fn, compute_kernel)


def module_table_configs(module: nn.Module) -> List[BaseEmbeddingConfig]:
    found = embedding_tables(module)
    if found is None:
        raise ValueError(f"{type(module).__name__} is not a shardable embedding collection")
    return found[0]


def _check_sharder(module: nn.Module, sharder: ModuleSharder) -> None:
    if not isinstance(module, sharder.module_type):
        raise ValueError(
            f"construct_module_sharding_plan: {type(sharder).__name__} shards "
            f"{sharder.module_type.__name__}, not {type(module).__name__}"
        )


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Dict[str, ShardingGenerator],
    sharder: ModuleSharder | None = None,
    local_size: int | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
) -> EmbeddingModuleShardingPlan:
    """A plan for one collection: `{table: ParameterSharding}` from per-table helpers.

    With `sharder`, each entry is checked against the sharder's module type, sharding types
    and compute kernels for `device_type` (default "cpu"; TorchRec defaults to CUDA when
    available). Tables may be a subset of the module's (TorchRec asks for all of them).
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    local_size = local_size or get_local_size(world_size)
    device_type = device_type or "cpu"
    configs = {c.name: c for c in module_table_configs(module)}
    if sharder is not None:
        _check_sharder(module, sharder)
    unknown = [t for t in per_param_sharding if t not in configs]
    if unknown:
        raise ValueError(
            f"construct_module_sharding_plan: tables {unknown} are not in the module "
            f"(its tables: {list(configs)})"
        )
    plan = {
        name: generate(configs[name], local_size, world_size, device_type, sharder)
        for name, generate in per_param_sharding.items()
    }
    sharding_types = (
        ALL_SHARDING_TYPES
        if sharder is None
        else {ShardingType(t) for t in sharder.sharding_types(device_type)}
    )
    owner = "the module" if sharder is None else type(sharder).__name__
    for name, ps in plan.items():
        kernels = None if sharder is None else _runnable_kernels(sharder, ps, device_type)
        check_table_plan(
            configs[name],
            ps,
            world_size,
            local_size,
            sharding_types=sharding_types,
            compute_kernels=kernels,
            owner=owner,
        )
    return plan
