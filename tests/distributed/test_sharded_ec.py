"""Sharded EC == unsharded EC: forward values and lengths, tables after 1 and 3 steps.

DP, TW, CW (uneven column splits), RW (fewer rows than ranks) and a mixed plan; fused (SGD,
row-wise Adagrad) and dense kernels; tables of dims 4, 6 and 8 in one collection; batch
size 1, a feature with no ids, `need_indices` with int32 ids, unequal batch sizes; a bad id on
rank 0 stops every rank. `shared` cases: features read by several tables (outputs `f@t`) in
every sharding type and in a mixed plan where each shared feature's tables differ in sharding
type; a shared feature's id that fits one of its tables but not the other is rejected naming
that table. World sizes 1-4, one spawned group per world size running every case.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch
from ebc_cases import LR, reference_update, state_mismatches
from ec_cases import batch, gather_tables, global_batch, make_ec, output_grads, plan_for
from multiprocess import run_ranks

from recshard import KeyedJaggedTensor
from recshard.distributed.embedding import EmbeddingCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, table_row_wise
from recshard.optim import in_backward_optimizer_filter
from recshard.types import ShardingEnv

KINDS = ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"]


@dataclass(frozen=True)
class EcCase:
    """One case: an equivalence run (`kind` a plan kind of `ec_cases.plan_for`), or one of
    the special runs "rejected" (a bad id on rank 0 stops every rank) and "errors"."""

    kind: str
    kernel: str = "fused"  # "fused" or "dense"
    optimizer: str = "sgd"  # fused optimizer: "sgd" or "rowwise_adagrad"
    batch_size: int = 3  # per rank
    steps: int = 2
    variant: str = ""  # "indices" (need_indices, int32 ids) or "uneven" (unequal batches)
    shared: bool = False  # `ec_cases.tables(shared=True)`: features read by several tables

    @property
    def name(self) -> str:
        shared = "/shared" if self.shared else ""
        if self.kind in ("rejected", "errors"):
            return self.kind + shared
        return (
            f"{self.kind}/{self.kernel}/{self.optimizer}/batch{self.batch_size}/"
            f"steps{self.steps}{'/' + self.variant if self.variant else ''}{shared}"
        )


def _env() -> ShardingEnv:
    return ShardingEnv.from_process_group(torch.distributed.group.WORLD)


def _shard(reference, kind: str, ws: int, kernel: str, optimizer: str, shared: bool = False):
    plan = construct_module_sharding_plan(
        reference, plan_for(kind, ws, kernel, shared), world_size=ws
    )
    fused = "exact_sgd" if optimizer == "sgd" else "exact_row_wise_adagrad"
    sharder = EmbeddingCollectionSharder(fused_params={"optimizer": fused, "learning_rate": LR})
    return plan, sharder.shard(copy.deepcopy(reference), plan, _env())


def run_case(
    rank: int,
    ws: int,
    kind: str,
    kernel: str,
    optimizer: str,
    batch_size: int,
    steps: int,
    variant: str = "",
    shared: bool = False,
) -> List[str]:
    """Mismatch descriptions (empty when everything matches). `variant`: "indices" (need_indices,
    int32 ids and lengths), "uneven" (rank r's batch is `batch_size + r % 2`)."""
    problems: List[str] = []
    need_indices = variant == "indices"
    dtype = torch.int32 if need_indices else torch.int64
    reference = make_ec(need_indices, shared=shared)
    plan, sharded = _shard(reference, kind, ws, kernel, optimizer, shared)
    dense_params = [p for _, p in in_backward_optimizer_filter(sharded.named_parameters())]
    dense_opt = torch.optim.SGD(dense_params, lr=LR) if dense_params else None
    state: Dict[str, Dict[str, torch.Tensor]] = {}
    for step in range(steps):
        parts = [
            batch(
                r,
                step,
                batch_size + (r % 2 if variant == "uneven" else 0),
                zero_feature=step == 1,
                dtype=dtype,
                shared=shared,
            )
            for r in range(ws)
        ]
        out = sharded(parts[rank]).wait()
        ref_out = reference(global_batch(parts))
        if list(out) != list(ref_out):
            problems.append(f"step {step}: keys {list(out)} != {list(ref_out)}")
        local_loss = torch.zeros(())
        ref_loss = torch.zeros(())
        for key, ref_jt in ref_out.items():  # key: the feature, or `feature@table`
            feature = key.partition("@")[0]
            counts = [p[feature].values().numel() for p in parts]
            ref_rows = list(ref_jt.values().split(counts))
            jt = out[key]
            if jt.values().shape != ref_rows[rank].shape or not torch.allclose(
                jt.values(), ref_rows[rank], atol=1e-5
            ):
                problems.append(
                    f"step {step}: output {key} values differ "
                    f"({tuple(jt.values().shape)} vs {tuple(ref_rows[rank].shape)})"
                )
            if not torch.equal(jt.lengths(), parts[rank][feature].lengths()):
                problems.append(f"step {step}: feature {feature} lengths differ")
            ids = parts[rank][feature].values()
            if need_indices and not torch.equal(jt.weights(), ids):
                problems.append(f"step {step}: feature {feature} indices differ")
            if not need_indices and jt.weights_or_none() is not None:
                problems.append(f"step {step}: feature {feature} has weights without need_indices")
            for r in range(ws):
                grad = output_grads(step, r, parts[r], shared)[key]
                ref_loss = ref_loss + (ref_rows[r] * grad).sum()
                if r == rank:
                    local_loss = local_loss + (jt.values() * grad).sum()
        local_loss.backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
        reference.zero_grad()
        (ref_loss / ws).backward()  # the mean over ranks of the per-rank gradients
        offsets: Dict[str, List[int]] = {}  # column offset of each block with its own state
        for name, emb in reference.embeddings.items():
            ps = plan[name]
            opt = "sgd" if kernel == "dense" or ps.sharding_type == "data_parallel" else optimizer
            blocks = (
                [s.shard_sizes[1] for s in ps.shards]
                if ps.sharding_type == "column_wise"
                else [emb.weight.size(1)]
            )
            reference_update(emb.weight, emb.weight.grad, state.setdefault(name, {}), opt, blocks)
            if opt == "rowwise_adagrad":
                offsets[name] = [sum(blocks[:i]) for i in range(len(blocks))]
        if step in (0, steps - 1):
            full = gather_tables(sharded, ws)
            for name, emb in reference.embeddings.items():
                if not torch.allclose(full[name], emb.weight, atol=1e-5):
                    diff = (full[name] - emb.weight).abs().nan_to_num(float("inf")).max()
                    problems.append(f"step {step}: table {name} differs by {diff:.3g}")
            problems += state_mismatches(sharded, ws, state, offsets, step)
    return problems


def run_rejected(rank: int, ws: int, shared: bool) -> List[str]:
    """Rank 0 sends an id past t4's 13 rows (`shared`: id 5 in f0, inside t0's 11 rows but
    past t1's 3): rank 0 names it, every other rank says rank 0 rejected its input; a later
    good batch still works."""
    reference = make_ec(shared=shared)
    _, sharded = _shard(reference, "mixed", ws, "fused", "sgd", shared)
    good = batch(rank, 0, 2, zero_feature=False, shared=shared)
    feature, bad_id = ("f0", 5) if shared else ("f5", 42)
    values = good.values().clone()
    if rank == 0:
        values[good.offset_per_key()[good.keys().index(feature)]] = bad_id
    bad = KeyedJaggedTensor.from_lengths_sync(good.keys(), values, good.lengths())
    if rank == 0 and good[feature].values().numel() == 0:  # only rank 0 needs one to spoil
        return [f"test batch has no {feature} ids"]
    try:
        sharded(bad).wait()
    except (ValueError, RuntimeError) as e:
        message = str(e)
    else:
        return ["bad batch did not raise"]
    expected = (
        "table 't1', feature 'f0@t1': id 5 is outside [0, 3)"
        if shared
        else "table 't4', feature 'f5': id 42 is outside [0, 13)"
    )
    if expected not in message:
        return [f"message {message!r} lacks {expected!r}"]
    if rank > 0 and not message.startswith("rank 0 rejected its input"):
        return [f"rank {rank}: {message!r}"]
    sharded(good).wait()
    return []


def run_errors(rank: int, ws: int) -> List[str]:
    """Plan and sharder checks: table_row_wise is refused, naming the table."""
    problems = []
    sharder = EmbeddingCollectionSharder()
    if set(sharder.sharding_types("cpu")) != {
        "data_parallel",
        "table_wise",
        "column_wise",
        "row_wise",
    }:
        problems.append(f"sharding_types {sharder.sharding_types('cpu')}")
    if sharder.compute_kernels("data_parallel", "cpu") != ["dense"]:
        problems.append("data_parallel kernels")
    reference = make_ec()
    if set(sharder.shardable_parameters(reference)) != {t for t in reference.embeddings}:
        problems.append("shardable_parameters")
    plan = construct_module_sharding_plan(
        reference,
        {
            "t0": table_row_wise(0),
            **{t: plan_for("row_wise", ws, "fused")[t] for t in ["t1", "t2", "t3", "t4"]},
        },
        world_size=ws,
    )
    try:
        sharder.shard(reference, plan, _env())
        problems.append("table_row_wise plan was accepted")
    except ValueError as e:
        if "table 't0'" not in str(e) or "table_row_wise" not in str(e):
            problems.append(f"unclear plan error: {e}")
    return problems


def run_all(rank: int, ws: int, cases: List[EcCase]) -> Dict[str, List[str]]:
    results: Dict[str, List[str]] = {}
    for case in cases:
        try:
            if case.kind == "rejected":
                results[case.name] = run_rejected(rank, ws, case.shared)
            elif case.kind == "errors":
                results[case.name] = run_errors(rank, ws)
            else:
                results[case.name] = run_case(
                    rank,
                    ws,
                    case.kind,
                    case.kernel,
                    case.optimizer,
                    case.batch_size,
                    case.steps,
                    case.variant,
                    case.shared,
                )
        except Exception as e:  # report per case, keep the group going
            results[case.name] = [f"raised {type(e).__name__}: {e}\n{traceback.format_exc()}"]
    return results


def cases_for(ws: int) -> List[EcCase]:
    cases: List[EcCase] = []
    for kind in KINDS:
        if kind != "data_parallel":
            cases.append(EcCase(kind, "fused", "sgd", batch_size=3, steps=3))
            cases.append(EcCase(kind, "fused", "rowwise_adagrad", batch_size=3, steps=3))
        cases.append(EcCase(kind, "dense", "sgd", batch_size=3, steps=2))
    cases.append(EcCase("mixed", "fused", "sgd", batch_size=1, steps=2, variant="indices"))
    cases.append(EcCase("row_wise", "fused", "sgd", batch_size=1, steps=2))
    if ws > 1:
        cases.append(
            EcCase("mixed", "fused", "rowwise_adagrad", batch_size=2, steps=2, variant="uneven")
        )
    cases.append(EcCase("rejected"))
    for kind in KINDS:  # features read by several tables
        cases.append(
            EcCase(
                kind,
                "dense" if kind == "data_parallel" else "fused",
                "rowwise_adagrad",
                batch_size=3,
                steps=2,
                shared=True,
            )
        )
    cases += [
        EcCase("mixed", "fused", "sgd", batch_size=2, steps=2, variant="indices", shared=True),
        EcCase("mixed", "dense", "sgd", batch_size=3, steps=2, shared=True),
        EcCase("rejected", shared=True),
    ]
    if ws > 1:
        cases.append(
            EcCase("mixed", "fused", "sgd", batch_size=2, steps=2, variant="uneven", shared=True)
        )
    if ws == 2:
        cases.append(EcCase("errors"))
    return cases


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_ec_equals_unsharded(world_size: int) -> None:
    results = run_ranks(world_size, run_all, cases_for(world_size), timeout=300)
    failures: Dict[str, List[str]] = {}
    for rank_results in results:
        for case, problems in rank_results.items():
            if problems and case not in failures:
                failures[case] = problems
    assert not failures, "\n".join(f"{c}: {p}" for c, p in failures.items())
