"""Quantized communication in training: fp16/bf16 codecs given to `EmbeddingBagCollectionSharder`
reach the output dist of every sharding type, both ways, and training still tracks fp32.

Every codec of the registry is wrapped in a counter, so the test sees which collective
encoded with which codec, in forward (embeddings) and backward (their gradients).

Tolerance for the losses (u: unit roundoff of the wire dtype, 2**-11 for fp16, 2**-8 for
bf16). A pooled embedding e crosses the wire rounded: an all-to-all rounds it once
(|de| <= u|e|); a reduce-scatter rounds each rank's partial pool and their sum
(|de| <= 2u * sum |partials|). Both are within 2u * sum over the bag's ids of |W[id]|, so to
first order the loss of step k moves by at most

    2u * S_k,   S_k = sum over bags and columns of |dL_k/de| * sum_{ids in bag} |W[id]|,

computed from the fp32 run (an unsharded reference on the global batch: the same losses as
DMP fp32). Earlier steps' rounding reaches step k through the weights (rounded embeddings and
rounded gradients in their updates); we allow it the same size as those steps' own forward
rounding, so step k may differ by `2u * (S_0 + ... + S_k)`. The bound assumes every
rounding error points the same way, so it sits well above what the runs show; what it
catches is a codec that does more than round (a wrong scale, a wrong dtype) — and a codec
that never runs is caught by requiring the runs to differ at all.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from typing import Any, Dict, List, Tuple

import pytest
import torch
from dmp_cases import LR, TinyDLRM, batch_for, make_optimizer, train
from multiprocess import run_ranks

from recshard.comm.codecs import CommOp, QuantizedCommCodecs, get_qcomm_codecs_registry
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from recshard.types import ShardingEnv, ShardingPlan

STEPS = 20
WIRE_EPS = {"fp16": 2.0**-11, "bf16": 2.0**-8}
TABLES = ["ta", "tb", "tc"]
# sharding type -> (per-table plan, local world size). table_row_wise runs inside one node
# of two ranks (its in-node reduce-scatter) and over two "nodes" of one rank (its cross-node
# all-to-all; the reduce-scatter over one rank is skipped).
KINDS = {
    "table_wise": (lambda ws: {t: table_wise(i % ws) for i, t in enumerate(TABLES)}, 2),
    "row_wise": (lambda ws: {t: row_wise() for t in TABLES}, 2),
    "column_wise": (lambda ws: {t: column_wise([1, 0]) for t in TABLES}, 2),
    "table_row_wise": (lambda ws: {t: table_row_wise(0) for t in TABLES}, 2),
    "table_row_wise_2nodes": (
        lambda ws: {t: table_row_wise(i % 2) for i, t in enumerate(TABLES)},
        1,
    ),
}


class CountingCodec:
    """Delegates to `codec`, counting `encode` calls under `key` ("<op>/<direction>")."""

    def __init__(self, codec: Any, counts: Counter, key: str) -> None:
        self._codec, self._counts, self._key = codec, counts, key

    def encode(self, input_tensor: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        self._counts[self._key] += 1
        return self._codec.encode(input_tensor, ctx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._codec, name)


def counting_registry(precision: str, counts: Counter) -> Dict[str, QuantizedCommCodecs]:
    registry = get_qcomm_codecs_registry(precision)
    assert registry is not None and set(registry) == {op.name for op in CommOp}
    return {
        op: QuantizedCommCodecs(
            CountingCodec(c.forward, counts, f"{op}/forward"),
            CountingCodec(c.backward, counts, f"{op}/backward"),
        )
        for op, c in registry.items()
    }


def train_with(rank: int, ws: int, kind: str, precision: str) -> Tuple[List[float], Dict[str, int]]:
    per_table, lws = KINDS[kind]
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD, local_world_size=lws)
    counts: Counter = Counter()
    registry = None if precision == "fp32" else counting_registry(precision, counts)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LR}, qcomm_codecs_registry=registry
    )
    plan = construct_module_sharding_plan(
        TinyDLRM("meta").ebc, per_table(ws), local_size=lws, world_size=ws
    )
    torch.manual_seed(0)
    dmp = DistributedModelParallel(
        TinyDLRM(), env=env, plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    losses = train(dmp, make_optimizer(dmp, fused=True, adagrad=False), range(STEPS), rank, ws)
    return losses, dict(counts)


def all_runs(rank: int, ws: int) -> Dict[str, Tuple[List[float], Dict[str, int]]]:
    return {
        f"{kind}/{precision}": train_with(rank, ws, kind, precision)
        for kind in KINDS
        for precision in ("fp32", "fp16", "bf16")
    }


RS, A2A = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name, CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name
# the collectives each sharding type's output dist runs, named by the registry entry TorchRec
# takes their codecs from
EXPECTED_OPS = {
    "table_wise": [A2A],
    "column_wise": [A2A],
    "row_wise": [RS],
    "table_row_wise": [RS],
    "table_row_wise_2nodes": [A2A],
}


def forward_sensitivity() -> List[float]:
    """S_k of the fp32 run (see the module docstring), from an unsharded reference."""
    torch.manual_seed(0)
    model = TinyDLRM()
    optimizer = make_optimizer(model, fused=False, adagrad=False)
    captured: Dict[str, torch.Tensor] = {}

    def keep_pooled(module: Any, inputs: Any, output: Any) -> None:
        output.values().retain_grad()
        captured["pooled"] = output.values()

    sensitivity = []
    for step in range(STEPS):
        dense, kjt, labels = batch_for(step, 0, 1)
        optimizer.zero_grad()
        hook = model.ebc.register_forward_hook(keep_pooled)
        model(dense, kjt, labels).backward()
        hook.remove()
        abs_tables = copy.deepcopy(model.ebc)
        with torch.no_grad():
            for bag in abs_tables.embedding_bags.values():
                bag.weight.abs_()
            abs_pooled = abs_tables(kjt).values()  # sum over each bag's ids of |W[id]|
        sensitivity.append((captured["pooled"].grad.abs() * abs_pooled).sum().item())
        optimizer.step()
    return sensitivity


@pytest.fixture(scope="module")
def allowance_per_unit_roundoff() -> torch.Tensor:
    """`2 * (S_0 + ... + S_k)` for every step k."""
    return 2 * torch.tensor(list(itertools.accumulate(forward_sensitivity())))


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Tuple[List[float], Dict[str, int]]]]:
    return run_ranks(2, all_runs, timeout=400)


@pytest.mark.parametrize("kind", list(KINDS))
def test_codecs_reach_every_output_dist_both_ways(runs, kind: str) -> None:
    for rank_runs in runs:
        for precision in ("fp16", "bf16"):
            counts = rank_runs[f"{kind}/{precision}"][1]
            for direction in ("forward", "backward"):
                encoded = sum(n for key, n in counts.items() if key.endswith(direction))
                assert encoded == STEPS * len(EXPECTED_OPS[kind]), (
                    kind,
                    precision,
                    direction,
                    counts,
                )


@pytest.mark.parametrize("kind", KINDS)
def test_each_collective_takes_its_own_registry_entry(runs, kind: str) -> None:
    counts = runs[0][f"{kind}/fp16"][1]
    for op in EXPECTED_OPS[kind]:
        for direction in ("forward", "backward"):
            assert counts.get(f"{op}/{direction}", 0) == STEPS, (kind, op, direction, counts)


@pytest.mark.parametrize("kind", list(KINDS))
def test_losses_with_fp16_and_bf16_codecs_track_fp32(
    runs, allowance_per_unit_roundoff, kind: str
) -> None:
    for rank_runs in runs:
        reference = torch.tensor(rank_runs[f"{kind}/fp32"][0])
        assert reference[-1] < reference[:3].mean()  # it trains
        for precision, unit_roundoff in WIRE_EPS.items():
            losses = torch.tensor(rank_runs[f"{kind}/{precision}"][0])
            diff = (losses - reference).abs()
            allowed = unit_roundoff * allowance_per_unit_roundoff
            assert bool((diff <= allowed).all()), (kind, precision, diff.tolist(), allowed.tolist())
            assert diff.max() > 0, (kind, precision)  # the codec really changed the numbers
