"""FP16 tables (`data_type=DataType.FP16`) train sharded as unsharded: forward, tables and the
fp32 optimizer state after 1 and 3 steps, through every sharding type and a mixed plan, with
fused SGD, row-wise Adagrad and Adagrad, at world sizes 1-3.

The oracle is an FP32 module holding the same fp16 values whose tables are rounded to fp16
after each update (as the FP16 tables store them). The two round at different points (fbgemm
rounds SGD's and Adagrad's update before adding it; ranks sum gradients in another order), so
tables may differ by one fp16 rounding per step: the tolerance is `step + 1` units in the last
place of the table's largest value (2^-10 relative), and forward sums of up to three weighted
rows get five times that. The optimizer state is fp32 on both sides (1e-5).
"""

from __future__ import annotations

import copy
import dataclasses
import traceback
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from ebc_cases import KINDS, LR, batch, gather_tables, global_batch, output_grad, plan_for, tables
from multiprocess import run_ranks

from recshard import DataType, EmbeddingBagCollection
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan
from recshard.optim import in_backward_optimizer_filter
from recshard.types import ShardingEnv

EPS = 1e-8
FP16_ULP = 2.0**-10  # fp16's spacing relative to a value's power of two
FUSED = {
    "sgd": "exact_sgd",
    "rowwise_adagrad": "exact_row_wise_adagrad",
    "adagrad": "exact_adagrad",
}
Case = Tuple[str, str, str, bool]  # plan kind, kernel, optimizer, weighted


def _modules(weighted: bool) -> Tuple[EmbeddingBagCollection, EmbeddingBagCollection]:
    """(FP16 module, FP32 reference holding the same fp16 values)."""
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(tables(), is_weighted=weighted)
    half = EmbeddingBagCollection(
        [dataclasses.replace(t, data_type=DataType.FP16) for t in tables()], is_weighted=weighted
    )
    with torch.no_grad():
        for name, bag in reference.embedding_bags.items():
            bag.weight.copy_(bag.weight.half().float())
            half.embedding_bags[name].weight.copy_(bag.weight)
    return half, reference


def _reference_step(
    weight: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor], opt: str, blocks
) -> None:
    """A dense optimizer's update with the averaged gradient, then the table rounded to fp16.
    Row-wise Adagrad keeps one accumulator per row per column shard (`blocks` widths)."""
    with torch.no_grad():
        if opt == "sgd":
            weight -= LR * grad
        elif opt == "adagrad":
            m = state.setdefault("m", torch.zeros_like(weight))
            m += grad * grad
            weight -= LR * grad / (m.sqrt() + EPS)
        else:
            start = 0
            for width in blocks:
                g = grad[:, start : start + width]
                m = state.setdefault(f"m{start}", torch.zeros(weight.size(0)))
                m += (g * g).mean(dim=1)
                weight[:, start : start + width] -= LR * g / (m.sqrt() + EPS).unsqueeze(1)
                start += width
        weight.copy_(weight.half().float())


def _gather_states(sharded, ws: int) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every rank's fused optimizer state assembled on every rank: per table, `m` `[rows,
    cols]` (Adagrad) or `m<column offset>` `[rows]` per column shard (row-wise Adagrad)."""
    local = [
        (name, table.row_offset, table.col_offset, state.detach().clone())
        for name, shards in sharded.fused_optimizer_states().items()
        for table, states in shards
        for state in states.values()
    ]
    gathered: List = [None] * ws
    dist.all_gather_object(gathered, local)
    configs = {t.name: t for t in sharded.table_configs()}
    full: Dict[str, Dict[str, torch.Tensor]] = {}
    for part in gathered:
        for name, row, col, state in part:
            rows, cols = configs[name].num_embeddings, configs[name].embedding_dim
            if state.dim() == 2:
                m = full.setdefault(name, {}).setdefault("m", torch.full((rows, cols), torch.nan))
                m[row : row + state.size(0), col : col + state.size(1)] = state
            else:
                m = full.setdefault(name, {}).setdefault(f"m{col}", torch.full((rows,), torch.nan))
                m[row : row + state.numel()] = state
    return full


def _compare(rank: int, ws: int, case: Case) -> List[str]:
    kind, kernel, optimizer, weighted = case
    steps, batch_size, problems = 3, 3, []
    env = ShardingEnv.from_process_group(dist.group.WORLD, local_world_size=ws)
    half, reference = _modules(weighted)
    plan = construct_module_sharding_plan(
        half, plan_for(kind, ws, ws, kernel), local_size=ws, world_size=ws
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": FUSED[optimizer], "learning_rate": LR}
    )
    sharded = sharder.shard(copy.deepcopy(half), plan, env)
    for name, shards in sharded.local_table_shards().items():
        for _, weight in shards:
            if weight.dtype != torch.float16:
                problems.append(f"table {name}: a shard holds {weight.dtype}, not float16")
    dense_params = [p for _, p in in_backward_optimizer_filter(sharded.named_parameters())]
    dense_opt = torch.optim.SGD(dense_params, lr=LR) if dense_params else None
    states: Dict[str, Dict[str, torch.Tensor]] = {}
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    for step in range(steps):
        ulp = (step + 1) * FP16_ULP
        local = batch(rank, step, batch_size, weighted, step == 1)
        out = sharded(local)
        ref_out = reference(global_batch(ws, step, batch_size, weighted, step == 1))
        largest = max(float(b.weight.abs().max()) for b in reference.embedding_bags.values())
        if out.values().dtype != torch.float32:
            problems.append(f"step {step}: output dtype {out.values().dtype}, not float32")
        diff = (out.values().float() - ref_out.values()[mine]).abs().max()
        if diff > 5 * ulp * largest + 1e-5:
            problems.append(f"step {step}: forward differs by {diff:.3g}")
        grad = output_grad(step, ws, batch_size, ref_out.values().size(1))
        (out.values() * grad[mine]).sum().backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
        reference.zero_grad()
        ((ref_out.values() * grad).sum() / ws).backward()
        fused_tables = []
        for name, bag in reference.embedding_bags.items():
            dense = kernel == "dense" or kind == "data_parallel" or (kind, name) == ("mixed", "t3")
            opt = "sgd" if dense else optimizer
            shards = plan[name].shards or []
            column_split = plan[name].sharding_type in ("column_wise", "table_column_wise")
            blocks = [sh.shard_sizes[1] for sh in shards] if column_split else [bag.weight.size(1)]
            _reference_step(bag.weight, bag.weight.grad, states.setdefault(name, {}), opt, blocks)
            if not dense and optimizer != "sgd":
                fused_tables.append(name)
        if step not in (0, steps - 1):
            continue
        full = gather_tables(sharded, ws)
        for name, bag in reference.embedding_bags.items():
            tol = ulp * float(bag.weight.abs().max()) + 1e-6
            diff = (full[name].float() - bag.weight).abs().nan_to_num(float("inf")).max()
            if diff > tol:
                problems.append(f"step {step}: table {name} differs by {diff:.3g} (> {tol:.3g})")
        got_states = _gather_states(sharded, ws)
        for name in fused_tables:
            for key, want in states[name].items():
                got = got_states.get(name, {}).get(key)
                if got is None or got.dtype != torch.float32 or not torch.allclose(got, want):
                    problems.append(f"step {step}: table {name} optimizer state {key} differs")
    return problems


def _run_all(rank: int, ws: int, cases: List[Case]) -> Dict[str, List[str]]:
    results = {}
    for case in cases:
        try:
            results["/".join(map(str, case))] = _compare(rank, ws, case)
        except Exception as e:  # report per case, keep the group going
            results["/".join(map(str, case))] = [f"raised {e!r}\n{traceback.format_exc()}"]
    return results


def _cases() -> List[Case]:
    cases: List[Case] = [(kind, "fused", optimizer, False) for kind in KINDS for optimizer in FUSED]
    return cases + [
        ("mixed", "fused", "rowwise_adagrad", True),
        ("mixed", "dense", "sgd", False),
    ]


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_fp16_tables_train_sharded_as_unsharded(world_size: int) -> None:
    results = run_ranks(world_size, _run_all, _cases(), timeout=300)
    failures = {c: p for rank_results in results for c, p in rank_results.items() if p}
    assert not failures, "\n".join(f"{c}: {p}" for c, p in failures.items())
