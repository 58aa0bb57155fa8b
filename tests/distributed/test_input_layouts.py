"""Every valid KJT layout gives the unsharded module's numbers, under every sharding type.

A layout is how the same batch is laid out in memory: `values`, `weights`, `lengths` and
`offsets` contiguous or strided views (every other element of a larger buffer whose gaps
hold ids no table has, so a kernel that reads a view as contiguous gives wrong numbers or
an error), the KJT built from lengths, from offsets or from both, int32 or int64 ids and
lengths, weighted or not, features with no ids, and a batch of zero samples. Hypothesis
draws a layout, 1-3 tables with any sharding type the collection supports (EBC: all six; EC:
data-parallel, table-, row- and column-wise), at world sizes 2 and 3 (one node or one rank
per node). Checked on every rank: forward values against the unsharded EBC / EC on the
global batch, and every table after one SGD step from a random upstream gradient (fused
tables update in backward; the update uses the mean over ranks of the gradients).

Cases are drawn in the parent (derandomized, no database, no shrinking); one group per world
size runs them all. To rerun a printed case alone: `run_ranks(ws, run_cases, [case])`.
"""

from __future__ import annotations

import copy
import functools
import traceback
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from drawn_cases import draw_distinct
from ebc_cases import LR, gather_tables
from hypothesis import strategies as st
from multiprocess import run_ranks

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from recshard.distributed import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
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
from recshard.types import ShardingEnv

WORLD_SIZES = [2, 3]
DEFAULT_CASES = 6  # per world size
SLOW_CASES = 150
POOLED_KINDS = [
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
]
SEQUENCE_KINDS = POOLED_KINDS[:4]
STRIDABLE = ["values", "weights", "lengths", "offsets"]
GAP_ID = 10**6  # what a strided view's gaps hold: no table has that row

Case = Dict[str, Any]  # plain data: picklable, printable, rebuilt identically on every rank

# --------------------------------------------------------------------------- strategies


@st.composite
def table_plans(draw: st.DrawFn, kinds: List[str], ws: int, lws: int) -> Dict[str, Any]:
    kind = draw(st.sampled_from(kinds))
    if kind == "table_wise":
        return {"kind": kind, "rank": draw(st.integers(0, ws - 1))}
    if kind == "column_wise":
        return {
            "kind": kind,
            "ranks": draw(st.lists(st.integers(0, ws - 1), min_size=1, max_size=2)),
        }
    if kind in ("table_row_wise", "table_column_wise"):
        return {"kind": kind, "host": draw(st.integers(0, ws // lws - 1))}
    return {"kind": kind}


@st.composite
def cases(draw: st.DrawFn, ws: int) -> Case:
    module = draw(st.sampled_from(["ebc", "ebc", "ec"]))
    lws = draw(st.sampled_from([ws, 1]))
    kinds = POOLED_KINDS if module == "ebc" else SEQUENCE_KINDS
    tables = [
        {
            "name": f"t{t}",
            "rows": draw(st.integers(1, 30)),
            "dim": draw(st.sampled_from([4, 8])),
            "pooling": draw(st.sampled_from(["SUM", "MEAN"])),
            "plan": draw(table_plans(kinds, ws, lws)),
        }
        for t in range(draw(st.integers(1, 3)))
    ]
    batch = draw(st.sampled_from([0, 1, 2, 3]))
    lengths = [  # [rank][feature][sample]; a feature may have no ids on a rank
        [
            draw(st.just([0] * batch) | st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
            for _ in tables
        ]
        for _ in range(ws)
    ]
    return {
        "ws": ws,
        "lws": lws,
        "module": module,
        "tables": tables,
        "weighted": module == "ebc" and draw(st.booleans()),
        "lengths": lengths,
        "build": draw(st.sampled_from(["lengths", "offsets", "both"])),
        "strided": sorted(draw(st.sets(st.sampled_from(STRIDABLE)))),
        "id_dtype": draw(st.sampled_from(["int32", "int64"])),
        "length_dtype": draw(st.sampled_from(["int32", "int64"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@functools.cache
def draw_cases(ws: int, count: int) -> List[Case]:
    """`count` distinct cases for world size `ws`, the same every run."""
    return draw_distinct(cases(ws), count)


# --------------------------------------------------------------------------- one case


def _strided(t: torch.Tensor, gap: float) -> torch.Tensor:
    """`t`'s values as a non-contiguous view: every other element of a buffer whose other
    elements are `gap`."""
    buffer = torch.full((2 * t.numel() + 1,), gap, dtype=t.dtype)
    buffer[0:-1:2] = t
    return buffer[0:-1:2]


def _features(case: Case) -> List[str]:
    return [f"f{i}" for i in range(len(case["tables"]))]


def _rank_data(case: Case, rank: int) -> Dict[str, torch.Tensor]:
    """Rank `rank`'s batch as contiguous int64 lengths/values and float weights."""
    g = torch.Generator().manual_seed(case["seed"] + 7919 * (rank + 1))
    per_feature = case["lengths"][rank]
    values = torch.cat(
        [torch.zeros(0, dtype=torch.int64)]
        + [
            torch.randint(0, t["rows"], (sum(n),), generator=g)
            for t, n in zip(case["tables"], per_feature)
        ]
    )
    return {
        "lengths": torch.tensor([n for ns in per_feature for n in ns], dtype=torch.int64),
        "values": values,
        "weights": torch.rand(values.numel(), generator=g) + 0.5,
    }


def laid_out(case: Case, rank: int) -> KeyedJaggedTensor:
    """Rank `rank`'s batch in the case's layout."""
    data = _rank_data(case, rank)
    id_dtype = getattr(torch, case["id_dtype"])
    length_dtype = getattr(torch, case["length_dtype"])
    values = data["values"].to(id_dtype)
    lengths = data["lengths"].to(length_dtype)
    offsets = torch.cat([torch.zeros(1, dtype=length_dtype), torch.cumsum(lengths, 0)]).to(
        length_dtype
    )
    weights = data["weights"] if case["weighted"] else None
    strided = case["strided"]
    if "values" in strided:
        values = _strided(values, GAP_ID)
    if weights is not None and "weights" in strided:
        weights = _strided(weights, 1e6)
    if "lengths" in strided:
        lengths = _strided(lengths, 10**4)
    if "offsets" in strided:
        offsets = _strided(offsets, 10**4)
    keys = _features(case)
    if case["build"] == "lengths":
        return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)
    if case["build"] == "offsets":
        return KeyedJaggedTensor.from_offsets_sync(keys, values, offsets, weights)
    batch = len(case["lengths"][rank][0])
    return KeyedJaggedTensor(keys, values, weights, lengths=lengths, offsets=offsets, stride=batch)


def global_batch(case: Case) -> KeyedJaggedTensor:
    """Every rank's batch stacked along the batch dimension (rank-major), contiguous int64."""
    parts = [_rank_data(case, r) for r in range(case["ws"])]
    batch = len(case["lengths"][0][0])
    values, lengths, weights = [], [], []
    for f in range(len(case["tables"])):
        for r, part in enumerate(parts):
            start = sum(sum(ns) for ns in case["lengths"][r][:f])
            count = sum(case["lengths"][r][f])
            values.append(part["values"][start : start + count])
            weights.append(part["weights"][start : start + count])
            lengths.append(part["lengths"][f * batch : (f + 1) * batch])
    return KeyedJaggedTensor.from_lengths_sync(
        _features(case),
        torch.cat(values),
        torch.cat(lengths),
        torch.cat(weights) if case["weighted"] else None,
    )


def _generator(plan: Dict[str, Any]):  # noqa: ANN202
    kind = plan["kind"]
    if kind == "table_wise":
        return table_wise(plan["rank"])
    if kind == "row_wise":
        return row_wise()
    if kind == "column_wise":
        return column_wise(plan["ranks"])
    if kind == "table_row_wise":
        return table_row_wise(plan["host"])
    if kind == "table_column_wise":
        return table_column_wise(plan["host"])
    return data_parallel()


def _reference(case: Case) -> torch.nn.Module:
    torch.manual_seed(case["seed"])
    if case["module"] == "ec":
        return EmbeddingCollection(
            [
                EmbeddingConfig(
                    num_embeddings=t["rows"],
                    embedding_dim=t["dim"],
                    name=t["name"],
                    feature_names=[f],
                )
                for t, f in zip(case["tables"], _features(case))
            ]
        )
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=t["rows"],
                embedding_dim=t["dim"],
                name=t["name"],
                feature_names=[f],
                pooling=PoolingType[t["pooling"]],
            )
            for t, f in zip(case["tables"], _features(case))
        ],
        is_weighted=case["weighted"],
    )


def _outputs(case: Case, out: Any) -> List[torch.Tensor]:
    """Forward output as one tensor per feature: EBC `[B, D_f]`, EC `[N_f, D_f]`."""
    if case["module"] == "ec":
        return [out[f].values() for f in _features(case)]
    return [out[f] for f in _features(case)]


def _my_rows(case: Case, rank: int, feature: int) -> slice:
    """This rank's rows of feature `feature` in the reference's global output."""
    if case["module"] == "ebc":
        batch = len(case["lengths"][0][0])
        return slice(rank * batch, (rank + 1) * batch)
    before = sum(sum(case["lengths"][r][feature]) for r in range(rank))
    return slice(before, before + sum(case["lengths"][rank][feature]))


def check_case(rank: int, case: Case) -> List[str]:
    """Mismatches between the sharded and the unsharded module on `case` (empty: all equal)."""
    ws = case["ws"]
    reference = _reference(case)
    env = ShardingEnv.from_process_group(dist.group.WORLD, local_world_size=case["lws"])
    plan = construct_module_sharding_plan(
        reference,
        {t["name"]: _generator(t["plan"]) for t in case["tables"]},
        local_size=case["lws"],
        world_size=ws,
    )
    fused = {"optimizer": "exact_sgd", "learning_rate": LR}
    sharder = (
        EmbeddingCollectionSharder(fused_params=fused)
        if case["module"] == "ec"
        else EmbeddingBagCollectionSharder(fused_params=fused)
    )
    sharded = sharder.shard(copy.deepcopy(reference), plan, env)
    dense_params = [p for _, p in in_backward_optimizer_filter(sharded.named_parameters())]
    features = laid_out(case, rank)
    out = sharded(features)
    out = out.wait() if hasattr(out, "wait") else out
    got = _outputs(case, out)
    expected = _outputs(case, reference(global_batch(case)))
    g = torch.Generator().manual_seed(case["seed"] + 1)
    grads = [torch.randn(e.shape, generator=g) for e in expected]
    problems: List[str] = []
    with torch.no_grad():  # the unsharded module reads the layout right too
        for f, alone in enumerate(_outputs(case, reference(features))):
            rows = _my_rows(case, rank, f)
            if alone.shape != expected[f][rows].shape or not torch.allclose(
                alone, expected[f][rows], atol=1e-5, rtol=1e-5
            ):
                problems.append(f"f{f}: the unsharded module differs on this layout")
    loss = torch.zeros(())
    for f, (mine, full, grad) in enumerate(zip(got, expected, grads)):
        rows = _my_rows(case, rank, f)
        same_shape = mine.shape == full[rows].shape
        if not same_shape:
            problems.append(f"f{f}: shape {tuple(mine.shape)} != {tuple(full[rows].shape)}")
        elif not torch.allclose(mine, full[rows], atol=1e-5, rtol=1e-5):
            problems.append(f"f{f}: forward differs by {(mine - full[rows]).abs().max():.3g}")
        if mine.requires_grad:  # every output, empty or not, on every rank: backward collectives
            loss = loss + (mine * (grad[rows] if same_shape else 0)).sum()
    if loss.requires_grad:
        loss.backward()
    if dense_params:
        torch.optim.SGD(dense_params, lr=LR).step()
    reference_loss = sum((full * grad).sum() for full, grad in zip(expected, grads)) / ws
    if isinstance(reference_loss, torch.Tensor) and reference_loss.requires_grad:
        reference_loss.backward()
    tables = (reference.embeddings if case["module"] == "ec" else reference.embedding_bags).items()
    with torch.no_grad():
        for _, table in tables:
            if table.weight.grad is not None:
                table.weight -= LR * table.weight.grad
    full_tables = gather_tables(sharded, ws)
    for name, table in tables:
        if not torch.allclose(full_tables[name], table.weight, atol=1e-5, rtol=1e-5):
            diff = (full_tables[name] - table.weight).abs().nan_to_num(float("inf")).max()
            problems.append(f"table {name} after one SGD step differs by {diff:.3g}")
    return problems


def run_cases(rank: int, ws: int, drawn: List[Case]) -> Dict[int, List[str]]:
    """Problems per case index. An exception ends the run: the ranks may be out of step."""
    results: Dict[int, List[str]] = {}
    for index, case in enumerate(drawn):
        assert case["ws"] == ws
        try:
            results[index] = check_case(rank, case)
        except Exception as e:  # noqa: BLE001 - reported with the case
            results[index] = [f"raised {type(e).__name__}: {e}\n{traceback.format_exc()}"]
            break
    return results


def _check(ws: int, drawn: List[Case], timeout: float) -> None:
    per_rank = run_ranks(ws, run_cases, drawn, timeout=timeout)
    failures = []
    for index, case in enumerate(drawn):
        problems = {r: res[index] for r, res in enumerate(per_rank) if res.get(index)}
        missing = [r for r, res in enumerate(per_rank) if index not in res]
        if problems or missing:
            detail = "; ".join(f"rank {r}: {p}" for r, p in problems.items()) or (
                f"not run on ranks {missing} (an earlier case raised)"
            )
            failures.append(f"case {index}: {detail}\n  {case}")
    assert not failures, f"{len(failures)} of {len(drawn)} cases failed:\n" + "\n".join(
        failures[:6]
    )


def strided_row_wise_case(ws: int) -> Case:
    """The layout issue #37 saw read wrong: strided values, weights and lengths into
    row-wise and table-row-wise tables (always in the default run)."""
    return {
        "ws": ws,
        "lws": ws,
        "module": "ebc",
        "tables": [
            {"name": "t0", "rows": 11, "dim": 4, "pooling": "SUM", "plan": {"kind": "row_wise"}},
            {
                "name": "t1",
                "rows": 7,
                "dim": 8,
                "pooling": "MEAN",
                "plan": {"kind": "table_row_wise", "host": 0},
            },
        ],
        "weighted": True,
        "lengths": [[[2, 0, 3], [1, 4, 0]] for _ in range(ws)],
        "build": "lengths",
        "strided": ["lengths", "values", "weights"],
        "id_dtype": "int64",
        "length_dtype": "int64",
        "seed": 37,
    }


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_every_layout_matches_unsharded(ws: int) -> None:
    _check(ws, [strided_row_wise_case(ws)] + draw_cases(ws, DEFAULT_CASES), timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_every_layout_matches_unsharded_many(ws: int) -> None:
    _check(ws, draw_cases(ws, SLOW_CASES), timeout=1200)


@pytest.mark.slow
def test_cases_cover_the_layouts() -> None:
    """The slow draw reaches every sharding type, every strided tensor, every way of building,
    both dtypes, weighted and not, both modules, empty features and zero batches, at both
    world sizes."""
    for ws in WORLD_SIZES:
        drawn = draw_cases(ws, SLOW_CASES)
        assert {t["plan"]["kind"] for c in drawn for t in c["tables"]} == set(POOLED_KINDS)
        assert {s for c in drawn for s in c["strided"]} == set(STRIDABLE)
        assert {c["build"] for c in drawn} == {"lengths", "offsets", "both"}
        assert {(c["id_dtype"], c["length_dtype"]) for c in drawn} == {
            (a, b) for a in ("int32", "int64") for b in ("int32", "int64")
        }
        assert {c["weighted"] for c in drawn} == {True, False}
        assert {c["module"] for c in drawn} == {"ebc", "ec"}
        assert any(len(c["lengths"][0][0]) == 0 for c in drawn)
        assert any(sum(c["lengths"][0][0]) == 0 < len(c["lengths"][0][0]) for c in drawn)
