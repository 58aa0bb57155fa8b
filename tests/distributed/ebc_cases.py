"""Shared fixtures for sharded-vs-unsharded equivalence: tables, plans, batches, references."""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recshard.optim import in_backward_optimizer_filter
from recshard.types import ShardedModule, ShardingEnv

LR = 0.1
EPS = 1e-8


def tables(shared: bool = False) -> List[EmbeddingBagConfig]:
    """A table with two features, MEAN, fewer rows than ranks, dims 1..8 (not all multiples
    of 4). `shared`: features read by several tables besides (f0 by t0 and MEAN t1, f1 by t0
    and t5, f3 by t2 and t5, f5 by t3 and t4); their ids fit the smallest table."""
    if shared:
        return [
            EmbeddingBagConfig(
                num_embeddings=11, embedding_dim=4, name="t0", feature_names=["f0", "f1"]
            ),
            EmbeddingBagConfig(
                num_embeddings=3,
                embedding_dim=3,
                name="t1",
                feature_names=["f2", "f0"],
                pooling=PoolingType.MEAN,
            ),
            EmbeddingBagConfig(num_embeddings=20, embedding_dim=6, name="t2", feature_names=["f3"]),
            EmbeddingBagConfig(
                num_embeddings=8, embedding_dim=1, name="t3", feature_names=["f4", "f5"]
            ),
            EmbeddingBagConfig(num_embeddings=13, embedding_dim=8, name="t4", feature_names=["f5"]),
            EmbeddingBagConfig(
                num_embeddings=7, embedding_dim=5, name="t5", feature_names=["f1", "f3"]
            ),
        ]
    return [
        EmbeddingBagConfig(
            num_embeddings=11, embedding_dim=4, name="t0", feature_names=["f0", "f1"]
        ),
        EmbeddingBagConfig(
            num_embeddings=3,
            embedding_dim=3,
            name="t1",
            feature_names=["f2"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=6, name="t2", feature_names=["f3"]),
        EmbeddingBagConfig(num_embeddings=8, embedding_dim=1, name="t3", feature_names=["f4"]),
        EmbeddingBagConfig(num_embeddings=13, embedding_dim=8, name="t4", feature_names=["f5"]),
    ]


KINDS = [  # the plan kinds of `plan_for`
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
    "data_parallel",
    "mixed",
]


def make_ebc(weighted: bool, seed: int = 0, shared: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    return EmbeddingBagCollection(tables(shared), is_weighted=weighted)


def plan_for(kind: str, ws: int, lws: int, kernel: str, shared: bool = False) -> Dict:
    """Per-table generators for a named plan kind. In "mixed", every shared feature is read
    by tables of two different sharding types (t5: table-column-wise)."""
    k = None if kernel == "fused" else "dense"
    names = [t.name for t in tables(shared)]
    nodes = ws // lws
    cw_ranks = [ws - 1 - (i % ws) for i in range(min(3, ws) if ws > 1 else 2)]
    if kind == "table_wise":
        return {n: table_wise(i % ws, compute_kernel=k) for i, n in enumerate(names)}
    if kind == "row_wise":
        return {n: row_wise(compute_kernel=k) for n in names}
    if kind == "column_wise":
        # t3 has dim 1: one column shard only
        return {n: column_wise(cw_ranks if n != "t3" else [0], compute_kernel=k) for n in names}
    if kind == "table_row_wise":
        return {n: table_row_wise(i % nodes, compute_kernel=k) for i, n in enumerate(names)}
    if kind == "table_column_wise":
        return {
            n: table_column_wise(i % nodes, None if n != "t3" else [0], compute_kernel=k)
            for i, n in enumerate(names)
        }
    if kind == "data_parallel":
        return {n: data_parallel() for n in names}
    if kind == "mixed":
        plan = {
            "t0": table_wise(ws - 1, compute_kernel=k),
            "t1": row_wise(compute_kernel=k),
            "t2": column_wise(cw_ranks, compute_kernel=k),
            "t3": data_parallel(),
            "t4": table_row_wise(nodes - 1, compute_kernel=k),
        }
        if shared:
            plan["t5"] = table_column_wise(0, compute_kernel=k)
        return plan
    raise ValueError(kind)


def batch(
    rank: int, step: int, batch_size: int, weighted: bool, zero_feature: bool, shared: bool = False
) -> KeyedJaggedTensor:
    """Rank `rank`'s batch at `step` (every rank can rebuild every other rank's batch)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows: Dict[str, int] = {}
    for t in tables(shared):
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    keys = [f"f{i}" for i in [5, 3, 0, 2, 4, 1]]  # input key order differs from the module's
    lengths = torch.randint(0, 4, (len(keys), batch_size), generator=g)
    if zero_feature:
        lengths[keys.index("f3")] = 0
    values = torch.cat(
        [
            torch.randint(0, rows[k], (int(lengths[i].sum()),), generator=g)
            for i, k in enumerate(keys)
        ]
    )
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths.reshape(-1), weights)


def global_batch(
    ws: int, step: int, batch_size: int, weighted: bool, zero: bool, shared: bool = False
) -> KeyedJaggedTensor:
    """All ranks' batches stacked along the batch dimension (rank-major), module key order."""
    parts = [batch(r, step, batch_size, weighted, zero, shared) for r in range(ws)]
    keys = parts[0].keys()
    values, lengths, weights = [], [], []
    for key in keys:
        for p in parts:
            jt = p[key]
            values.append(jt.values())
            lengths.append(jt.lengths())
            if weighted:
                weights.append(jt.weights())
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.cat(values), torch.cat(lengths), torch.cat(weights) if weighted else None
    )


def output_grad(step: int, ws: int, batch_size: int, width: int) -> torch.Tensor:
    return torch.randn(ws * batch_size, width, generator=torch.Generator().manual_seed(7 + step))


def gather_tables(sharded, ws: int) -> Dict[str, torch.Tensor]:
    """Every rank's shards, assembled into full tables on every rank."""
    local: List[Tuple[str, int, int, torch.Tensor]] = []
    for name, shards in sharded.local_table_shards().items():
        for table, weight in shards:
            local.append((name, table.row_offset, table.col_offset, weight.detach().clone()))
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


def gather_row_states(sharded, ws: int) -> Dict[str, Dict[int, torch.Tensor]]:
    """Every rank's per-row fused optimizer state (row-wise Adagrad's accumulator), assembled
    on every rank: `{table: {column offset of the shard: [num_embeddings]}}` (SGD: empty)."""
    local = [
        (name, table.row_offset, table.col_offset, state.detach().reshape(-1).clone())
        for name, shards in sharded.fused_optimizer_states().items()
        for table, states in shards
        for state in states.values()
    ]
    gathered: List = [None] * ws
    dist.all_gather_object(gathered, local)
    rows = {t.name: t.num_embeddings for t in sharded.table_configs()}
    full: Dict[str, Dict[int, torch.Tensor]] = {}
    for part in gathered:
        for name, row, col, state in part:
            column = full.setdefault(name, {}).setdefault(
                col, torch.full((rows[name],), float("nan"))
            )
            column[row : row + state.numel()] = state
    return full


def reference_update(
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: Dict[str, torch.Tensor],
    optimizer: str,
    column_blocks: List[int],
) -> None:
    """The update a dense optimizer makes with the averaged gradient `grad`.

    Row-wise Adagrad keeps one accumulator per row per column shard (`column_blocks` widths):
    a column shard's optimizer sees only its own columns.
    """
    with torch.no_grad():
        if optimizer == "sgd":
            weight -= LR * grad
            return
        start = 0
        for i, width in enumerate(column_blocks):
            g = grad[:, start : start + width]
            m = state.setdefault(f"m{i}", torch.zeros(weight.size(0)))
            m += (g * g).mean(dim=1)
            weight[:, start : start + width] -= LR * g / (m.sqrt() + EPS).unsqueeze(1)
            start += width


def state_mismatches(
    sharded,
    ws: int,
    state: Dict[str, Dict[str, torch.Tensor]],
    offsets: Dict[str, List[int]],
    step: int,
) -> List[str]:
    """Where the sharded row-wise Adagrad accumulators differ from `reference_update`'s
    (`state[table]["m<i>"]` for the column block starting at `offsets[table][i]`)."""
    row_states = gather_row_states(sharded, ws)
    problems = []
    for name, columns in offsets.items():
        got = row_states.get(name, {})
        for i, offset in enumerate(columns):
            if offset not in got or not torch.allclose(
                got[offset], state[name][f"m{i}"], atol=1e-5
            ):
                problems.append(
                    f"step {step}: table {name} optimizer state of the columns "
                    f"from {offset} differs"
                )
    return problems


def step_reference_and_compare(
    sharded,
    reference: EmbeddingBagCollection,
    plan: Dict,
    kind: str,
    kernel: str,
    optimizer: str,
    state: Dict[str, Dict[str, torch.Tensor]],
    ws: int,
    step: int,
    compare: bool = True,
) -> List[str]:
    """Step the reference's tables as the sharded kernels do (dense kernels, data-parallel
    tables and the mixed plan's t3 by SGD, the rest by `optimizer`, row-wise Adagrad per column
    block), then (if `compare`) where the sharded tables and accumulators differ from them."""
    offsets: Dict[str, List[int]] = {}  # column offset of each block with its own state
    for name, bag in reference.embedding_bags.items():
        dense = kernel == "dense" or kind == "data_parallel" or (kind == "mixed" and name == "t3")
        opt = "sgd" if dense else optimizer
        shards = plan[name].shards or []
        column_split = plan[name].sharding_type in ("column_wise", "table_column_wise")
        blocks = [sh.shard_sizes[1] for sh in shards] if column_split else [bag.weight.size(1)]
        reference_update(bag.weight, bag.weight.grad, state.setdefault(name, {}), opt, blocks)
        if opt == "rowwise_adagrad":
            offsets[name] = [sum(blocks[:i]) for i in range(len(blocks))]
    if not compare:
        return []
    problems = []
    full = gather_tables(sharded, ws)
    for name, bag in reference.embedding_bags.items():
        if not torch.allclose(full[name], bag.weight, atol=1e-5):
            diff = (full[name] - bag.weight).abs().nan_to_num(float("inf")).max()
            problems.append(f"step {step}: table {name} differs by {diff:.3g}")
    return problems + state_mismatches(sharded, ws, state, offsets, step)


def shard_reference(
    reference: EmbeddingBagCollection,
    kind: str,
    ws: int,
    lws: int,
    kernel: str,
    optimizer: str,
    shared: bool = False,
) -> Tuple[Dict, ShardedModule, torch.optim.Optimizer | None]:
    """A copy of `reference` sharded by the plan kind (fused `optimizer`: "sgd" or
    "rowwise_adagrad"), with that plan and an SGD over its dense parameters (None if none)."""
    env = ShardingEnv.from_process_group(dist.group.WORLD, local_world_size=lws)
    plan = construct_module_sharding_plan(
        reference, plan_for(kind, ws, lws, kernel, shared), local_size=lws, world_size=ws
    )
    fused = "exact_sgd" if optimizer == "sgd" else "exact_row_wise_adagrad"
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": fused, "learning_rate": LR})
    sharded = sharder.shard(copy.deepcopy(reference), plan, env)
    dense = [p for _, p in in_backward_optimizer_filter(sharded.named_parameters())]
    return plan, sharded, torch.optim.SGD(dense, lr=LR) if dense else None
