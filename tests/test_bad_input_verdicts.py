"""Bad input on one rank stops every rank, for every kind of sharded module and plan.

`test_bad_inputs.py` covers a mixed EBC plan; here rank 1 gets each bad batch and rank 0 a
good one under data-parallel-only and mixed plans of the EBC, the EC and the quantized EBC
and EC, including float64 and non-finite per-id weights and lengths that do not match values.
Rank 1 must raise the reason (naming table/feature), rank 0 "rank 1 rejected its input: ..."
at once (a rank left waiting would hit the 300 s process-group timeout, far past the
harness's limit), and then a good step must go through on both (nothing left half-issued).
Non-finite weights under WARNING are dropped once-warned, as out-of-range ids are.
"""

from __future__ import annotations

import logging
import re
from typing import Dict, List, Tuple

import pytest
import torch
from multiprocess import run_ranks

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from recshard.distributed import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recshard.distributed.quant_embedding import QuantEmbeddingCollectionSharder
from recshard.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recshard.types import BoundsCheckMode, ShardingEnv

KEYS = ["f0", "f1"]
ROWS = {"t0": 10, "t1": 6}


def _configs(bags: bool) -> List:
    kind = EmbeddingBagConfig if bags else EmbeddingConfig
    return [
        kind(num_embeddings=ROWS[t], embedding_dim=4, name=t, feature_names=[f])
        for t, f in zip(ROWS, KEYS)
    ]


def _module(kind: str, weighted: bool) -> Tuple[torch.nn.Module, object, bool]:
    """(unsharded module, sharder, trains) for `kind` in ebc / ec / qebc / qec."""
    torch.manual_seed(0)
    if kind == "ebc":
        return (
            EmbeddingBagCollection(_configs(True), is_weighted=weighted),
            EmbeddingBagCollectionSharder(),
            True,
        )
    if kind == "ec":
        return EmbeddingCollection(_configs(False)), EmbeddingCollectionSharder(), True
    if kind == "qebc":
        return (
            QuantEmbeddingBagCollection.from_float(
                EmbeddingBagCollection(_configs(True), is_weighted=weighted), torch.qint8
            ),
            QuantEmbeddingBagCollectionSharder(),
            False,
        )
    return (
        QuantEmbeddingCollection.from_float(EmbeddingCollection(_configs(False)), torch.qint8),
        QuantEmbeddingCollectionSharder(),
        False,
    )


def _plan(kind: str, plan: str, module: torch.nn.Module, ws: int) -> Dict:
    kernel = "quant" if kind.startswith("q") else None
    dp = data_parallel(compute_kernel=kernel) if kernel else data_parallel()
    other = (
        row_wise(compute_kernel=kernel)
        if kind.endswith("ebc")
        else table_wise(1, compute_kernel=kernel)
    )
    per_table = {"t0": dp, "t1": dp if plan == "data_parallel" else other}
    return construct_module_sharding_plan(module, per_table, world_size=ws)


def _kjt(
    values: List,
    lengths: List[int],
    weights: torch.Tensor | None = None,
    keys: List[str] = KEYS,
    validate: bool = True,
) -> KeyedJaggedTensor:
    values_t = torch.tensor(values)
    if validate:
        return KeyedJaggedTensor.from_lengths_sync(keys, values_t, torch.tensor(lengths), weights)
    return KeyedJaggedTensor(keys, values_t, weights, lengths=torch.tensor(lengths), validate=False)


def _good(weighted: bool) -> KeyedJaggedTensor:
    return _kjt([1, 2, 3, 4, 5], [2, 1, 1, 1], torch.ones(5) if weighted else None)


def bad_batches(weighted: bool) -> Dict[str, Tuple[KeyedJaggedTensor, str]]:
    w = torch.ones(5) if weighted else None
    cases = {
        "id out of range": (
            _kjt([1, 2, 3, 6, 5], [2, 1, 1, 1], w),
            r"table 't1', feature 'f1': id 6 is outside \[0, 6\)",
        ),
        "negative id": (
            _kjt([1, -2, 3, 4, 5], [2, 1, 1, 1], w),
            r"table 't0', feature 'f0': id -2 is outside \[0, 10\)",
        ),
        "missing feature": (
            _kjt([1, 2, 3], [2, 1], w[:3] if weighted else None, keys=["f0"]),
            r"features \['f1'\] are missing",
        ),
        "float ids": (
            _kjt([1.0, 2, 3, 4, 5], [2, 1, 1, 1], w, validate=False),
            "ids must be int32 or int64, got torch.float32",
        ),
        "lengths/values mismatch": (
            _kjt([1, 2, 3, 4], [2, 1, 1, 1], w[:4] if weighted else None, validate=False),
            r"lengths sum to 5 .* but values has 4 entries",
        ),
    }
    if weighted:
        nan, inf = torch.ones(5), torch.ones(5)
        nan[1], inf[4] = float("nan"), float("inf")
        cases.update(
            {
                "float64 weights": (
                    _kjt([1, 2, 3, 4, 5], [2, 1, 1, 1], torch.ones(5, dtype=torch.float64)),
                    "per-id weights must be float32, got torch.float64",
                ),
                "nan weight": (
                    _kjt([1, 2, 3, 4, 5], [2, 1, 1, 1], nan),
                    r"table 't0', feature 'f0': weight nan at position 1 of the feature's "
                    r"values is not finite",
                ),
                "inf weight": (
                    _kjt([1, 2, 3, 4, 5], [2, 1, 1, 1], inf),
                    r"table 't1', feature 'f1': weight inf at position 1 of the feature's "
                    r"values is not finite",
                ),
            }
        )
    return cases


def _step(sharded: torch.nn.Module, kjt: KeyedJaggedTensor, trains: bool) -> Tuple[int, ...]:
    out = sharded(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    tensor = (
        out.values()
        if hasattr(out, "values") and callable(out.values) and not isinstance(out, dict)
        else torch.cat([jt.values() for jt in out.values()])
    )
    if trains:
        tensor.sum().backward()
    return tuple(tensor.shape)


def run_cases(rank: int, ws: int, kind: str, plan: str, weighted: bool) -> Dict[str, List[str]]:
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    module, sharder, trains = _module(kind, weighted)
    sharded = sharder.shard(module, _plan(kind, plan, module, ws), env)
    outcome: Dict[str, List[str]] = {}
    for name, (bad, _) in bad_batches(weighted).items():
        try:
            with torch.set_grad_enabled(trains):
                _step(sharded, bad if rank == 1 else _good(weighted), trains)
            outcome[name] = ["no error", ""]
        except (ValueError, RuntimeError) as e:
            outcome[name] = [type(e).__name__, str(e)]
        with torch.set_grad_enabled(trains):
            outcome[name].append(f"after: {_step(sharded, _good(weighted), trains)}")
    return outcome


MODULES = [
    ("ebc", "data_parallel", True),
    ("ebc", "mixed", True),
    ("ec", "data_parallel", False),
    ("ec", "mixed", False),
    ("qebc", "data_parallel", True),
    ("qebc", "mixed", True),
    ("qec", "data_parallel", False),
]


@pytest.mark.parametrize("kind, plan, weighted", MODULES)
def test_bad_input_on_one_rank_stops_every_rank(kind: str, plan: str, weighted: bool) -> None:
    results = run_ranks(2, run_cases, kind, plan, weighted, timeout=150, pg_timeout_s=300)
    for name, (_, message) in bad_batches(weighted).items():
        kind1, text1, after1 = results[1][name]
        kind0, text0, after0 = results[0][name]
        assert kind1 == "ValueError" and re.search(message, text1), (name, kind1, text1)
        assert kind0 == "RuntimeError" and "rank 1 rejected its input" in text0, (name, text0)
        assert after0 == after1, (name, after0, after1)


def run_warning_mode(rank: int, ws: int, plan: str) -> Dict[str, object]:
    """Table t0 under WARNING: its non-finite weights are dropped, logged once."""
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    module, sharder, _ = _module("ebc", True)
    sharding_plan = _plan("ebc", plan, module, ws)
    sharding_plan["t0"].bounds_check_mode = BoundsCheckMode.WARNING
    sharded = sharder.shard(module, sharding_plan, env)
    records: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("recshard.modules.input_checks").addHandler(handler)
    weights = torch.tensor([1.0, float("nan"), 1.0, 1.0, 1.0])
    got = sharded(_kjt([1, 2, 3, 4, 5], [2, 1, 1, 1], weights)).values()
    sharded(_kjt([1, 2, 3, 4, 5], [2, 1, 1, 1], weights)).values()  # no second warning
    expected = sharded(_kjt([1, 3, 4, 5], [1, 1, 1, 1], torch.ones(4))).values()
    return {"same": bool(torch.equal(got, expected)), "warnings": records}


@pytest.mark.parametrize("plan", ["data_parallel", "mixed"])
def test_nonfinite_weights_dropped_under_warning(plan: str) -> None:
    for result in run_ranks(2, run_warning_mode, plan, timeout=120):
        assert result["same"]
        warnings = [w for w in result["warnings"] if "non-finite per-id weights" in w]
        assert len(warnings) == 1 and "table 't0'" in warnings[0], result["warnings"]


def test_unsharded_modules_name_nonfinite_weights_on_validate_and_reject_float64() -> None:
    """Forward makes no pass over the per-id weights (#19: O(1) checks on the unsharded hot
    path); `validate_input` names the bad weight."""
    ebc = EmbeddingBagCollection(_configs(True), is_weighted=True)
    weights = torch.ones(5)
    weights[3] = float("-inf")
    features = _kjt([1, 2, 3, 4, 5], [2, 1, 1, 1], weights)
    assert not torch.isfinite(ebc(features).values()).all()
    with pytest.raises(ValueError, match=r"table 't1', feature 'f1': weight -inf at position 0"):
        ebc.validate_input(features)
    with pytest.raises(ValueError, match="per-id weights must be float32, got torch.float64"):
        ebc(_kjt([1, 2, 3, 4, 5], [2, 1, 1, 1], torch.ones(5, dtype=torch.float64)))


def error_paths(rank: int, ws: int) -> int:
    """Every rejection path of the modules above, then a clean return (the harness checks the
    process's exit code after it returned)."""
    done = 0
    for kind, plan, weighted in MODULES:
        done += len(run_cases(rank, ws, kind, plan, weighted))
    return done


@pytest.mark.parametrize("repeats", [3, pytest.param(50, marks=pytest.mark.slow)])
def test_ranks_that_handled_errors_exit_cleanly(repeats: int) -> None:
    """ "terminate called without an active exception" (exit -6) was seen at interpreter exit
    after handled errors; every run must exit 0."""
    for _ in range(repeats):
        counts = run_ranks(2, error_paths, timeout=300, pg_timeout_s=300)
        assert counts[0] == counts[1] > 0
