"""Fixtures for sharded-vs-unsharded EmbeddingCollection equivalence: tables, plans, batches."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from recshard import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from recshard.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_wise
from recshard.modules.embedding_tables import embedding_names

KEYS = ["f5", "f3", "f0", "f2", "f4", "f1"]  # input key order differs from the module's


def tables(shared: bool = False) -> List[EmbeddingConfig]:
    """A table with two features, fewer rows than ranks (t1), dims 4, 6 and 8 (one sequence
    all-to-all per width), column splits that come out uneven (4 -> 2,1,1; 8 -> 3,3,2).
    `shared`: features read by several tables besides (f0 by t0 and t1, f1 by t0 and t5, f3
    by t2 and t5, f5 by t3 and t4); their ids fit the smallest table."""
    return [
        EmbeddingConfig(num_embeddings=11, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
        EmbeddingConfig(
            num_embeddings=3,
            embedding_dim=4,
            name="t1",
            feature_names=["f2", "f0"] if shared else ["f2"],
        ),
        EmbeddingConfig(num_embeddings=20, embedding_dim=6, name="t2", feature_names=["f3"]),
        EmbeddingConfig(
            num_embeddings=8,
            embedding_dim=4,
            name="t3",
            feature_names=["f4", "f5"] if shared else ["f4"],
        ),
        EmbeddingConfig(num_embeddings=13, embedding_dim=8, name="t4", feature_names=["f5"]),
    ] + (
        [EmbeddingConfig(num_embeddings=7, embedding_dim=4, name="t5", feature_names=["f1", "f3"])]
        if shared
        else []
    )


def make_ec(need_indices: bool = False, seed: int = 0, shared: bool = False) -> EmbeddingCollection:
    torch.manual_seed(seed)
    return EmbeddingCollection(tables(shared), need_indices=need_indices)


def plan_for(kind: str, ws: int, kernel: str, shared: bool = False) -> Dict:
    """Per-table generators for a named plan kind. In "mixed", every shared feature is read
    by tables of two different sharding types (t5: row-wise)."""
    k = None if kernel == "fused" else "dense"
    names = [t.name for t in tables(shared)]
    cw_ranks = [ws - 1 - (i % ws) for i in range(min(3, ws) if ws > 1 else 2)]
    if kind == "table_wise":
        return {n: table_wise(i % ws, compute_kernel=k) for i, n in enumerate(names)}
    if kind == "row_wise":
        return {n: row_wise(compute_kernel=k) for n in names}
    if kind == "column_wise":
        return {n: column_wise(cw_ranks, compute_kernel=k) for n in names}
    if kind == "data_parallel":
        return {n: data_parallel() for n in names}
    if kind == "mixed":
        plan = {
            "t0": table_wise(ws - 1, compute_kernel=k),
            "t1": row_wise(compute_kernel=k),
            "t2": column_wise(cw_ranks, compute_kernel=k),
            "t3": data_parallel(),
            "t4": column_wise(cw_ranks[::-1], compute_kernel=k),
        }
        if shared:
            plan["t5"] = row_wise(compute_kernel=k)
        return plan
    raise ValueError(kind)


def batch(
    rank: int,
    step: int,
    batch_size: int,
    zero_feature: bool,
    dtype: torch.dtype = torch.int64,
    shared: bool = False,
) -> KeyedJaggedTensor:
    """Rank `rank`'s batch at `step` (every rank can rebuild every other rank's batch);
    `dtype` of ids and lengths."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows: Dict[str, int] = {}
    for t in tables(shared):
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    lengths = torch.randint(0, 4, (len(KEYS), batch_size), generator=g)
    if zero_feature:
        lengths[KEYS.index("f3")] = 0
    values = torch.cat(
        [
            torch.randint(0, rows[k], (int(lengths[i].sum()),), generator=g)
            for i, k in enumerate(KEYS)
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(
        KEYS, values.to(dtype), lengths.reshape(-1).to(dtype)
    )


def global_batch(parts: List[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """All ranks' batches stacked along the batch dimension (rank-major)."""
    keys = parts[0].keys()
    values = [p[k].values() for k in keys for p in parts]
    lengths = [p[k].lengths() for k in keys for p in parts]
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values), torch.cat(lengths))


def output_grads(
    step: int, rank: int, kjt: KeyedJaggedTensor, shared: bool = False
) -> Dict[str, torch.Tensor]:
    """Upstream gradient of rank `rank`'s output, `[N_f, D_t]` per output key (embedding name)."""
    g = torch.Generator().manual_seed(7 + 100 * step + rank)
    configs = tables(shared)
    reads = [(f, t.embedding_dim) for t in configs for f in t.feature_names]
    return {
        name: torch.randn(kjt[f].values().numel(), dim, generator=g)
        for name, (f, dim) in zip(embedding_names(configs), reads)
    }


def gather_tables(sharded, ws: int) -> Dict[str, torch.Tensor]:
    """Every rank's shards, assembled into full tables on every rank."""
    local = [
        (name, table.row_offset, table.col_offset, weight.detach().clone())
        for name, shards in sharded.local_table_shards().items()
        for table, weight in shards
    ]
    gathered: List = [None] * ws
    dist.all_gather_object(gathered, local)
    full = {
        t.name: torch.full((t.num_embeddings, t.embedding_dim), float("nan"))
        for t in sharded.table_configs()
    }
    for part in gathered:
        for name, row, col, weight in part:
            full[name][row : row + weight.size(0), col : col + weight.size(1)] = weight
    return full
