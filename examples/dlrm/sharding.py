"""The sharding plan and optimizers the DLRM CLI uses (`--sharding`, `--plan`, `--kernel`,
`--optimizer`, `--key-value-tables`, `--dram-budget`, `--kv-dir`, `--cache-load-factor`)."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

from examples.dlrm.mc import MC_NAME, ManagedCollisionSparse
from recshard import EmbeddingBagConfig, ShardingPlan
from recshard.comm import get_qcomm_codecs_registry
from recshard.distributed import (
    EmbeddingBagCollectionSharder,
    ManagedCollisionEmbeddingBagCollectionSharder,
)
from recshard.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    ShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from recshard.types import ModuleSharder

EBC_PATH = "model.sparse_arch.embedding_bag_collection"
SHARDING_CHOICES = [
    "auto",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "data_parallel",
]
OPTIMIZER_CHOICES = ["sgd", "adagrad", "rowwise_adagrad"]
_FUSED_NAME = {
    "sgd": "exact_sgd",
    "adagrad": "exact_adagrad",
    "rowwise_adagrad": "exact_row_wise_adagrad",
}


def _generator(
    kind: str, table_index: int, world_size: int, local_size: int, kernel: str
) -> ShardingGenerator:
    """Per-table helper for one uniform sharding type; tables round-robin over ranks/hosts."""
    if kind == "table_wise":
        return table_wise(rank=table_index % world_size, compute_kernel=kernel)
    if kind == "row_wise":
        return row_wise(compute_kernel=kernel)
    if kind == "column_wise":
        return column_wise(ranks=list(range(world_size)), compute_kernel=kernel)
    if kind == "table_row_wise":
        num_hosts = max(1, world_size // local_size)
        return table_row_wise(host_index=table_index % num_hosts, compute_kernel=kernel)
    if kind == "data_parallel":
        return data_parallel(compute_kernel="dense")
    raise ValueError(f"unknown sharding {kind!r}; choose from {SHARDING_CHOICES}")


def make_plan(
    kind: str,
    model: nn.Module,
    tables: List[EmbeddingBagConfig],
    world_size: int,
    local_size: int,
    kernel: str,
    sharders: List[ModuleSharder],
    batch_size: int,
    pooling_factor: float = 1.0,
    device_type: str = "cpu",
    plan_path: str | None = None,
    key_value_tables: Sequence[str] = (),
    dram_budget_gib: float | None = None,
    kv_dir: str | None = None,
) -> Tuple[ShardingPlan, str]:
    """The plan for the DLRM's EBC and a line about it (collective for "auto").

    `plan_path`: a JSON plan file. "auto": recshard's planner (rank 0 plans for this batch
    size and ids per bag, every rank gets the plan; `--kernel dense` restricts it to dense
    kernels; `key_value_tables` are planned key_value; `dram_budget_gib`, each rank's DRAM,
    makes it plan tables that do not fit key_value, in the free space of `kv_dir`).
    Otherwise every table is sharded the same way, `key_value_tables` on key_value.
    """
    if plan_path:
        from recshard.planner import load_plan

        return load_plan(plan_path), f"loaded from {plan_path}"
    if kind == "auto":
        from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

        constraints = {
            t.name: ParameterConstraints(
                compute_kernels=["dense"]
                if kernel == "dense"
                else (["key_value"] if t.name in key_value_tables else None),
                pooling_factors=[pooling_factor] * len(t.feature_names),
            )
            for t in tables
        }
        on_storage = key_value_tables or dram_budget_gib is not None
        planner = EmbeddingShardingPlanner(
            topology=Topology(
                world_size=world_size,
                compute_device=device_type,
                local_world_size=local_size,
                ddr_cap=None if dram_budget_gib is None else dram_budget_gib * 2**30,
                storage_cap=free_storage_bytes(kv_dir, local_size) if on_storage else None,
            ),
            batch_size=batch_size,
            constraints=constraints,
            debug=False,
        )
        plan = planner.collective_plan(model, sharders)
        stats = planner.last_stats  # rank 0 only: it planned
        note = "recshard planner"
        if stats is not None:
            note += (
                f", {stats.num_proposals} proposals in {stats.plan_time_s:.2f}s, estimated "
                f"imbalance {stats.imbalance:.2f}, memory imbalance "
                f"{stats.memory_imbalance:.2f}"
            )
        return plan, note
    path, module = collection_path(model)
    per_table = {
        t.name: _generator(
            kind, i, world_size, local_size, "key_value" if t.name in key_value_tables else kernel
        )
        for i, t in enumerate(tables)
    }
    module_plan = construct_module_sharding_plan(
        module, per_table, local_size=local_size, world_size=world_size, device_type=device_type
    )
    return ShardingPlan(plan={path: module_plan}), f"every table {kind}"


def collection_path(model: nn.Module) -> Tuple[str, nn.Module]:
    """The sharded collection's path in the training module, and the collection: the EBC,
    or the ManagedCollisionEmbeddingBagCollection inside `examples.dlrm.mc`'s wrapper."""
    module = model.get_submodule(EBC_PATH)
    if isinstance(module, ManagedCollisionSparse):
        return f"{EBC_PATH}.{MC_NAME}", module.managed_collision
    return EBC_PATH, module


def free_storage_bytes(kv_dir: str | None, local_size: int) -> float:
    """Each rank's share of the free space where key_value files go (`kv_dir`, whose
    `@local_rank` parts are left out, else the temporary directory), shared by a host's ranks."""
    directory = (kv_dir or tempfile.gettempdir()).split("@local_rank")[0] or "."
    directory = directory if os.path.isdir(directory) else os.path.dirname(directory) or "."
    stat = os.statvfs(directory)
    return float(stat.f_bavail * stat.f_frsize) / max(1, local_size)


def make_sharders(
    optimizer: str,
    lr: float,
    eps: float = 1e-8,
    comm_precision: str = "fp32",
    key_value: Dict[str, Any] | None = None,
) -> List[ModuleSharder]:
    """The EBC sharder with the fused (in-backward) embedding optimizer, and fp16/bf16 codecs
    on the pooled all-to-alls and reduce-scatters (forward and backward) if asked; the same
    for the EBC inside a FeatureProcessedEmbeddingBagCollection (`--position-weighted`) and a
    ManagedCollisionEmbeddingBagCollection (`--managed-collision`).
    `key_value`: the key_value tables' fused params (`ssd_storage_directory`,
    `cache_load_factor`)."""
    fused = {"optimizer": _FUSED_NAME[optimizer], "learning_rate": lr, "eps": eps}
    fused.update(key_value or {})
    registry = get_qcomm_codecs_registry(comm_precision)  # None for fp32
    ebc = EmbeddingBagCollectionSharder(fused_params=fused, qcomm_codecs_registry=registry)
    return [
        ebc,
        FeatureProcessedEmbeddingBagCollectionSharder(ebc),
        ManagedCollisionEmbeddingBagCollectionSharder(ebc, qcomm_codecs_registry=registry),
    ]


def dense_optimizer_factory(
    optimizer: str, lr: float, eps: float = 1e-8
) -> Callable[[List[torch.Tensor]], torch.optim.Optimizer]:
    """Torch optimizer for the dense arch and dense-kernel tables: SGD, or Adagrad for both
    Adagrad choices (as TorchRec's DLRM example)."""
    if optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    return lambda params: torch.optim.Adagrad(params, lr=lr, eps=eps)


def plan_table(plan: ShardingPlan, tables: List[EmbeddingBagConfig]) -> str:
    """The plan as an aligned text table: one line per table with its shards."""
    sizes: Dict[str, EmbeddingBagConfig] = {t.name: t for t in tables}
    header = ["table", "rows x dim", "sharding", "kernel", "ranks", "shards (rows x cols @ rank)"]
    rows = []
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():
            config = sizes.get(name)
            shape = f"{config.num_embeddings} x {config.embedding_dim}" if config else "?"
            shards = (
                "replicated"
                if not ps.shards
                else ", ".join(
                    f"{s.shard_sizes[0]}x{s.shard_sizes[1]}@{s.rank}" for s in ps.shards[:4]
                )
                + (f", ... ({len(ps.shards)} shards)" if len(ps.shards) > 4 else "")
            )
            ranks = "all" if ps.ranks is None else ",".join(map(str, ps.ranks))
            rows.append([name, shape, ps.sharding_type, ps.compute_kernel, ranks, shards])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])
