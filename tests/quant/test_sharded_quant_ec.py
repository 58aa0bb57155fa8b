"""Sharded quantized EmbeddingCollection == the unsharded quantized one, at world sizes 2 and 3.

Each rank's output depends only on its own batch, so the reference is the unsharded
`QuantEmbeddingCollection` applied to that batch: same ids, same lengths, same rows (every
shard holds an exact slice of the quantized rows, so values agree to float rounding).
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from multiprocess import run_ranks

from recshard import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from recshard.distributed import (
    DistributedModelParallel,
    QuantEmbeddingCollectionSharder,
    ShardedQuantEmbeddingCollection,
)
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.quant import QuantEmbeddingCollection, quantize_embeddings
from recshard.types import ShardingEnv, ShardingPlan

Q = "quant"
ROWS = {"t0": 11, "t1": 1, "t2": 20}


def tables() -> List[EmbeddingConfig]:
    """Two dims (8 and 16), shared features, a 1-row table (empty row-wise shards)."""
    return [
        EmbeddingConfig(num_embeddings=11, embedding_dim=8, name="t0", feature_names=["f0", "f1"]),
        EmbeddingConfig(num_embeddings=1, embedding_dim=8, name="t1", feature_names=["f2"]),
        EmbeddingConfig(num_embeddings=20, embedding_dim=16, name="t2", feature_names=["f3"]),
    ]


def plans(ws: int) -> Dict[str, Dict]:
    last = ws - 1
    return {
        "table_wise": {
            "t0": table_wise(last, compute_kernel=Q),
            "t1": table_wise(0, compute_kernel=Q),
            "t2": table_wise(last, compute_kernel=Q),
        },
        "row_wise": {n: row_wise(compute_kernel=Q) for n in ROWS},
        "column_wise": {
            n: column_wise([last, 0], compute_kernel=Q) for n in ROWS
        },  # even widths (INT4)
        "data_parallel": {n: data_parallel(compute_kernel=Q) for n in ROWS},
        "mixed": {
            "t0": data_parallel(compute_kernel=Q),
            "t1": row_wise(compute_kernel=Q),
            "t2": column_wise([0, last], compute_kernel=Q),
        },
    }


def local_batch(rank: int, seed: int, batch_size: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    rows = {"f3": 20, "f0": 11, "f2": 1, "f1": 11}  # not the module's key order
    lengths = torch.randint(0, 4, (len(rows), batch_size), generator=g)
    values = torch.cat(
        [
            torch.randint(0, n, (int(lengths[i].sum()),), generator=g)
            for i, n in enumerate(rows.values())
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(list(rows), values, lengths.reshape(-1))


def compare(rank: int, ws: int) -> Dict[str, List[str]]:
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    problems: Dict[str, List[str]] = {}
    cases = [
        (dtype, kind, torch.float32, False)
        for dtype in (torch.qint8, torch.quint4x2)
        for kind in plans(ws)
    ]
    cases += [
        (torch.float16, "row_wise", torch.float16, True),
        (torch.quint2x4, "mixed", torch.float32, True),
    ]
    for dtype, kind, output_dtype, need_indices in cases:
        torch.manual_seed(0)
        qec = QuantEmbeddingCollection.from_float(
            EmbeddingCollection(tables(), need_indices=need_indices), dtype, output_dtype
        )
        plan = construct_module_sharding_plan(qec, plans(ws)[kind], world_size=ws)
        sharded = QuantEmbeddingCollectionSharder().shard(qec, plan, env)
        key, found = f"{dtype}/{kind}/{output_dtype}", []
        for step in range(2):
            kjt = local_batch(rank, step, 3 if rank == 0 or step == 0 else 2)  # unequal sizes
            with torch.no_grad():
                got, want = sharded(kjt).wait(), qec(kjt)
            if list(got) != list(want):
                found.append(f"keys {list(got)} != {list(want)}")
            for feature, jt in want.items():
                mine = got[feature]
                if mine.values().dtype != jt.values().dtype or not torch.allclose(
                    mine.values(), jt.values(), atol=1e-5
                ):
                    found.append(f"step {step} {feature}: values differ")
                if not torch.equal(mine.lengths(), jt.lengths()):
                    found.append(f"step {step} {feature}: lengths differ")
                if need_indices and not torch.equal(mine.weights(), jt.weights()):
                    found.append(f"step {step} {feature}: indices differ")
        problems[key] = found
    return problems


def dmp_default_sharders(rank: int, ws: int) -> List[str]:
    """DMP with no sharders given finds the quantized EC's sharder."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.ec = quantize_embeddings(EmbeddingCollection(tables()), torch.qint8)
    reference = model.ec
    plan = ShardingPlan(
        {
            "ec": construct_module_sharding_plan(
                model.ec, {n: row_wise(compute_kernel=Q) for n in ROWS}, world_size=ws
            )
        }
    )
    dmp = DistributedModelParallel(model, plan=plan, init_data_parallel=False)
    if not isinstance(dmp.module.ec, ShardedQuantEmbeddingCollection):
        return [f"DMP built {type(dmp.module.ec).__name__}"]
    kjt = local_batch(rank, 5, 3)
    with torch.no_grad():
        got, want = dmp.module.ec(kjt).wait(), reference(kjt)
    return [f for f in want if not torch.allclose(got[f].values(), want[f].values(), atol=1e-5)]


def run_all(rank: int, ws: int) -> tuple:
    return compare(rank, ws), dmp_default_sharders(rank, ws)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_quant_ec_equals_unsharded(world_size: int) -> None:
    results = run_ranks(world_size, run_all, timeout=300)
    for rank, (problems, dmp_problems) in enumerate(results):
        bad = {case: p for case, p in problems.items() if p}
        assert not bad, (rank, bad)
        assert not dmp_problems, (rank, dmp_problems)


def test_quant_ec_plans_are_checked_before_sharding() -> None:
    env = ShardingEnv.from_local(2, 0)
    qec = QuantEmbeddingCollection.from_float(EmbeddingCollection(tables()), torch.quint4x2)
    sharder = QuantEmbeddingCollectionSharder()
    assert sharder.compute_kernels("row_wise", "cpu") == ["quant"]
    assert "table_row_wise" not in sharder.sharding_types("cpu")
    fused = construct_module_sharding_plan(
        qec,
        {
            "t0": table_wise(0),
            "t1": table_wise(0, compute_kernel=Q),
            "t2": table_wise(1, compute_kernel=Q),
        },
        world_size=2,
    )
    with pytest.raises(ValueError, match=r"table 't0'.*QuantEmbeddingCollection.*'quant'.*'fused'"):
        sharder.shard(qec, fused, env)
