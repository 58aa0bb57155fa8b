"""Bad input: a clear error on the rank that holds it, a quick error on every other rank.

Each case gives rank 0 a bad batch and rank 1 a good one; both must raise (rank 0 the
reason, rank 1 "rank 0 rejected its input"), then both run a good step (no hang, no stale
state). Plans that cannot work fail at shard time, naming the table.
"""

from __future__ import annotations

import copy
import re
from typing import Dict, List, Tuple

import pytest
import torch
from ebc_cases import make_ebc, plan_for
from multiprocess import run_ranks

from recshard import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from recshard.distributed import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    table_row_wise,
    table_wise,
)
from recshard.types import ShardingEnv


def good_batch() -> KeyedJaggedTensor:
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.tensor([1, 2, 0, 3, 1, 4]), torch.ones(6, dtype=torch.int32)
    )


def bad_batches() -> Dict[str, Tuple[KeyedJaggedTensor, str]]:
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]
    ones = torch.ones(6, dtype=torch.int32)
    return {
        "id out of range": (
            KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor([1, 2, 9, 3, 1, 4]), ones),
            r"table 't1', feature 'f2': id 9 is outside \[0, 3\)",
        ),
        "negative id": (
            KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor([1, 2, 0, -3, 1, 4]), ones),
            r"table 't2', feature 'f3': id -3 is outside \[0, 20\)",
        ),
        "missing feature": (
            KeyedJaggedTensor.from_lengths_sync(keys[:5], torch.tensor([1, 2, 0, 3, 1]), ones[:5]),
            r"features \['f5'\] are missing",
        ),
        "unknown feature": (
            KeyedJaggedTensor.from_lengths_sync(
                keys + ["zz"], torch.tensor([1, 2, 0, 3, 1, 4, 0]), torch.ones(7, dtype=torch.int32)
            ),
            r"features \['zz'\] that no table reads",
        ),
        "float ids": (
            KeyedJaggedTensor(
                keys, torch.tensor([1.0, 2, 0, 3, 1, 4]), lengths=ones, validate=False
            ),
            "ids must be int32 or int64, got torch.float32",
        ),
        "weights on unweighted": (
            KeyedJaggedTensor.from_lengths_sync(
                keys, torch.tensor([1, 2, 0, 3, 1, 4]), ones, weights=torch.ones(6)
            ),
            "carries weights but the collection is unweighted",
        ),
        "lengths/values mismatch": (
            KeyedJaggedTensor(keys, torch.tensor([1, 2, 0, 3, 1]), lengths=ones, validate=False),
            r"lengths sum to 6 .* but values has 5 entries",
        ),
        # int32 lengths past 2**31 in all: their int32 offsets would wrap ("offsets
        # decrease", or a values count from a wrapped sum); refused before the values check
        "int32 lengths sum past 2**31": (
            KeyedJaggedTensor.from_lengths_sync(
                keys,
                good_batch().values(),
                torch.tensor([2**30, 2**30 - 1, 1, 1, 0, 0], dtype=torch.int32),
            ),
            r"int32 lengths sum to 2147483649, past 2\*\*31 - 1 = 2147483647 at key 'f2'",
        ),
        # offsets given beside lengths must be their running sum (tests/test_bad_offsets.py)
        "offsets step past lengths": (
            KeyedJaggedTensor(
                keys,
                good_batch().values(),
                lengths=ones,
                offsets=torch.tensor([0, 2, 2, 3, 4, 5, 6]),
            ),
            "offsets are not the running sum",
        ),
        "offsets decrease": (
            KeyedJaggedTensor(
                keys,
                good_batch().values(),
                lengths=ones,
                offsets=torch.tensor([0, 6, 2, 3, 4, 5, 6]),
            ),
            r"offsets decrease at entry 2 \(key 'f1'\)",
        ),
    }


def run_bad_cases(rank: int, ws: int) -> Dict[str, List[str]]:
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    reference = make_ebc(False)
    plan = construct_module_sharding_plan(
        reference, plan_for("mixed", ws, ws, "fused"), world_size=ws
    )
    sharded = EmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
    outcome: Dict[str, List[str]] = {}
    for name, (bad, _) in bad_batches().items():
        features = bad if rank == 0 else good_batch()
        try:
            sharded(features).values().sum().backward()
            outcome[name] = ["no error"]
        except (ValueError, RuntimeError) as e:
            outcome[name] = [type(e).__name__, str(e)]
        # the group is still usable: a good step goes through on both ranks
        out = sharded(good_batch())
        out.values().sum().backward()
        outcome[name].append(f"after: {tuple(out.values().shape)}")
    return outcome


def test_every_rank_stops_with_a_clear_error() -> None:
    results = run_ranks(2, run_bad_cases, timeout=180)
    for name, (_, message) in bad_batches().items():
        kind0, text0, after0 = results[0][name]
        kind1, text1, after1 = results[1][name]
        assert kind0 == "ValueError", (name, text0)
        assert re.search(message, text0), (name, text0)
        assert kind1 == "RuntimeError" and "rank 0 rejected its input" in text1, (name, text1)
        assert after0 == after1 == "after: (1, 26)", (name, after0, after1)


@pytest.mark.parametrize("offsets_first", [False, True], ids=["lengths", "offsets-computed"])
def test_int32_lengths_past_2_31_name_the_key_and_sum_unsharded(offsets_first: bool) -> None:
    """The unsharded collection and `validate()` give the same message, also when the
    (wrapped) offsets were already computed from the lengths."""
    features, message = bad_batches()["int32 lengths sum past 2**31"]
    if offsets_first:
        assert int(features.offsets()[-1]) < 0  # wrapped
    with pytest.raises(ValueError, match=message):
        features.validate()
    with pytest.raises(ValueError, match=message):
        make_ebc(False)(features)


def test_plan_errors_at_shard_time_name_the_table() -> None:
    env = ShardingEnv.from_local(2, 0)
    ebc = make_ebc(False)
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(ebc, plan_for("column_wise", 2, 2, "fused"), world_size=2)
    plan["ghost"] = plan["t0"]
    with pytest.raises(ValueError, match=r"names tables \['ghost'\] that the module lacks"):
        sharder.shard(ebc, plan, env)
    del plan["ghost"]
    plan["t2"].shards[1].shard_sizes[1] -= 1
    with pytest.raises(ValueError, match="table 't2': column shards cover 5 of 6"):
        sharder.shard(ebc, plan, env)
    with pytest.raises(ValueError, match=r"table 't0': ranks \[5\] are outside world size 2"):
        construct_module_sharding_plan(ebc, {"t0": table_wise(5)}, world_size=2)
    plan = construct_module_sharding_plan(ebc, plan_for("table_wise", 2, 2, "fused"), world_size=2)
    plan["t1"].sharding_type = "diagonal"
    with pytest.raises(ValueError, match="table 't1': unknown sharding type 'diagonal'"):
        sharder.shard(ebc, plan, env)
    ec = EmbeddingCollection([EmbeddingConfig(num_embeddings=4, embedding_dim=4, name="s")])
    ec_plan = construct_module_sharding_plan(
        ec, {"s": table_row_wise(0)}, world_size=2, local_size=2
    )
    with pytest.raises(ValueError, match="table 's': .* does not support table_row_wise"):
        EmbeddingCollectionSharder().shard(ec, ec_plan, env)


def run_unequal_batches(rank: int, ws: int) -> List[str]:
    """Rank r has batch size 3 - r: outputs equal the unsharded module's rows for that rank."""
    from ebc_cases import batch

    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    reference = make_ebc(False)
    problems = []
    for kind in ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"]:
        plan = construct_module_sharding_plan(
            reference,
            plan_for(kind, ws, 1, "fused"),
            world_size=ws,
            local_size=1 if kind == "mixed" else ws,
        )
        if kind == "mixed":  # table-row-wise needs equal batches: keep it out
            plan = construct_module_sharding_plan(
                reference, {**plan_for(kind, ws, 1, "fused"), "t4": table_wise(0)}, world_size=ws
            )
        sharded = EmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
        out = sharded(batch(rank, 0, 3 - rank, False, False))
        expected = reference(batch(rank, 0, 3 - rank, False, False))
        if not torch.allclose(out.values(), expected.values(), atol=1e-6):
            problems.append(kind)
        out.values().sum().backward()
    return problems


def test_unequal_batch_sizes_across_ranks() -> None:
    assert run_ranks(2, run_unequal_batches, timeout=120) == [[], []]


def run_bounds_modes(rank: int, ws: int) -> Dict[str, object]:
    """t1 WARNING, t2 IGNORE, t3 NONE via the plan; others FATAL (the default)."""
    import logging

    from recshard.types import BoundsCheckMode

    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    reference = make_ebc(False)
    plan = construct_module_sharding_plan(
        reference, plan_for("table_wise", ws, ws, "fused"), world_size=ws
    )
    plan["t1"].bounds_check_mode = BoundsCheckMode.WARNING
    plan["t2"].bounds_check_mode = "ignore"
    sharded = EmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]
    # f2 (t1, 3 rows): id 7 is bad; f3 (t2, 20 rows): id 25 is bad
    bad = KeyedJaggedTensor.from_lengths_sync(
        keys,
        torch.tensor([1, 2, 0, 7, 25, 3, 1, 4]),
        torch.tensor([1, 1, 2, 2, 1, 1], dtype=torch.int32),
    )
    clean = KeyedJaggedTensor.from_lengths_sync(
        keys, torch.tensor([1, 2, 0, 3, 1, 4]), torch.ones(6, dtype=torch.int32)
    )
    records: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("recshard.modules.input_checks").addHandler(handler)
    got = sharded(bad).values()
    sharded(bad).values()  # a second bad batch: no second warning
    expected = sharded(clean).values()
    fatal = KeyedJaggedTensor.from_lengths_sync(
        keys, torch.tensor([11, 2, 0, 3, 1, 4]), torch.ones(6, dtype=torch.int32)
    )
    try:
        sharded(fatal if rank == 1 else clean).values()
        error = "none"
    except (ValueError, RuntimeError) as e:
        error = str(e)
    return {"same": bool(torch.allclose(got, expected)), "warnings": records, "error": error}


def test_bounds_check_modes_per_table() -> None:
    results = run_ranks(2, run_bounds_modes, timeout=120)
    for rank, result in enumerate(results):
        assert result["same"], rank  # bad ids dropped, the rest pooled as without them
        warnings = [w for w in result["warnings"] if "table 't1'" in w]
        assert len(warnings) == 1 and "bounds_check_mode=WARNING" in warnings[0]
        assert not any("table 't2'" in w for w in result["warnings"])  # IGNORE is silent
    assert "table 't0', feature 'f0': id 11 is outside [0, 11)" in results[1]["error"]
    assert "rank 1 rejected its input" in results[0]["error"]


def run_shared_feature_bounds(rank: int, ws: int) -> Dict[str, bool]:
    """f0 is read by t0 (11 rows, FATAL) and t1 (3 rows, IGNORE): id 5 is dropped from t1's
    copy of f0 only, t0 still pools it."""
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    reference = make_ebc(False, shared=True)
    plan = construct_module_sharding_plan(
        reference, plan_for("mixed", ws, ws, "fused", shared=True), world_size=ws
    )
    plan["t1"].bounds_check_mode = "ignore"
    sharded = EmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]

    def one_sample(f0_ids: List[int]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(
            keys,
            torch.tensor(f0_ids + [1, 2, 3, 4, 5]),
            torch.tensor([len(f0_ids), 1, 1, 1, 1, 1], dtype=torch.int32),
        )

    with_bad = sharded(one_sample([5, 1]))
    without = sharded(one_sample([1]))
    t0 = reference.embedding_bags["t0"].weight
    return {
        "t1 dropped it": bool(torch.allclose(with_bad["f0@t1"], without["f0@t1"])),
        "t0 pooled it": bool(torch.allclose(with_bad["f0@t0"][0], t0[5] + t0[1], atol=1e-6)),
        "others untouched": all(
            bool(torch.allclose(with_bad[k], without[k]))
            for k in with_bad.keys()
            if not k.startswith("f0@")
        ),
    }


def test_shared_feature_bounds_checked_per_table() -> None:
    for result in run_ranks(2, run_shared_feature_bounds, timeout=120):
        assert all(result.values()), result
