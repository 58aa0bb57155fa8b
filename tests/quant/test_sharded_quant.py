"""Sharded quantized inference == the unsharded quantized module, at world size 2.

Each rank's output depends only on its own batch, so the reference is the unsharded
`QuantEmbeddingBagCollection` applied to that batch. Row shards and column shards hold
exact slices of the quantized rows, so the outputs agree to float rounding.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from dmp_cases import TinyDLRM, batch_for
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from recshard.distributed import DistributedModelParallel
from recshard.distributed.quant_embeddingbag import (
    QuantEmbeddingBagCollectionSharder,
    ShardedQuantEmbeddingBagCollection,
)
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recshard.quant import QuantEmbeddingBagCollection, quantize_embeddings
from recshard.types import ShardingEnv, ShardingPlan

Q = "quant"


def tables() -> List[EmbeddingBagConfig]:
    """Shared features, MEAN, a 1-row table (an empty row-wise shard on rank 1)."""
    return [
        EmbeddingBagConfig(
            num_embeddings=11, embedding_dim=8, name="t0", feature_names=["f0", "f1"]
        ),
        EmbeddingBagConfig(
            num_embeddings=1,
            embedding_dim=4,
            name="t1",
            feature_names=["f2"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=16, name="t2", feature_names=["f3"]),
    ]


PLANS = {
    "table_wise": {
        "t0": table_wise(1, compute_kernel=Q),
        "t1": table_wise(0, compute_kernel=Q),
        "t2": table_wise(1, compute_kernel=Q),
    },
    "row_wise": {n: row_wise(compute_kernel=Q) for n in ("t0", "t1", "t2")},
    "column_wise": {n: column_wise([1, 0], compute_kernel=Q) for n in ("t0", "t1", "t2")},
    "mixed": {
        "t0": data_parallel(compute_kernel=Q),
        "t1": table_row_wise(0, compute_kernel=Q),
        "t2": column_wise([0, 1], compute_kernel=Q),
    },
}


def local_batch(rank: int, seed: int, batch_size: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    rows = {"f3": 20, "f0": 11, "f2": 1, "f1": 11}  # not the module's key order
    lengths = torch.randint(0, 4, (len(rows), batch_size), generator=g)
    values = torch.cat(
        [
            torch.randint(0, n, (int(lengths[i].sum()),), generator=g)
            for i, n in enumerate(rows.values())
        ]
    )
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(list(rows), values, lengths.reshape(-1), weights)


def sharded_equals_unsharded(rank: int, ws: int) -> Dict[str, float]:
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    worst: Dict[str, float] = {}
    cases = [
        (dtype, kind, False)
        for dtype in (torch.qint8, torch.quint4x2, torch.float16)
        for kind in ("table_wise", "row_wise")
    ]
    cases += [
        (torch.quint4x2, "column_wise", False),
        (torch.quint2x4, "mixed", False),
        (torch.qint8, "row_wise", True),
        (torch.qint8, "mixed", True),
    ]
    for dtype, kind, weighted in cases:
        torch.manual_seed(0)
        qebc = QuantEmbeddingBagCollection.from_float(
            EmbeddingBagCollection(tables(), weighted), dtype
        )
        plan = construct_module_sharding_plan(qebc, PLANS[kind], world_size=ws)
        sharded = QuantEmbeddingBagCollectionSharder().shard(qebc, plan, env)
        for step in range(2):
            batch_size = 3 if rank == 0 or step == 0 else 2  # step 1: unequal batch sizes
            kjt = local_batch(rank, step, batch_size, weighted)
            with torch.no_grad():
                got, want = sharded(kjt).wait(), qebc(kjt)
            assert got.keys() == want.keys(), (got.keys(), want.keys())
            key = f"{dtype}/{kind}/{'weighted' if weighted else 'unweighted'}"
            worst[key] = max(worst.get(key, 0.0), (got.values() - want.values()).abs().max().item())
    return worst


def dmp_inference(rank: int, ws: int) -> Dict[str, float]:
    """A trained TinyDLRM, quantized to INT4, under DMP: its loss equals the unsharded one's."""
    out = {}
    for kind in ("table_wise", "row_wise"):
        torch.manual_seed(0)
        model = quantize_embeddings(TinyDLRM(), torch.quint4x2)
        per_table = (
            {
                "ta": table_wise(0, compute_kernel=Q),
                "tb": table_wise(1, compute_kernel=Q),
                "tc": table_wise(1, compute_kernel=Q),
            }
            if kind == "table_wise"
            else {t: row_wise(compute_kernel=Q) for t in ("ta", "tb", "tc")}
        )
        plan = ShardingPlan(
            {"ebc": construct_module_sharding_plan(model.ebc, per_table, world_size=ws)}
        )
        dmp = DistributedModelParallel(
            model,
            plan=plan,
            sharders=[QuantEmbeddingBagCollectionSharder()],
            init_data_parallel=False,
        )
        assert isinstance(dmp.module.ebc, ShardedQuantEmbeddingBagCollection)
        for step in range(2):
            dense, kjt, labels = batch_for(step, rank, ws)
            with torch.no_grad():
                got, want = dmp(dense, kjt, labels), model(dense, kjt, labels)
            out[kind] = max(out.get(kind, 0.0), abs(got.item() - want.item()))
    return out


def both(rank: int, ws: int) -> tuple:
    return sharded_equals_unsharded(rank, ws), dmp_inference(rank, ws)


def test_sharded_quant_equals_unsharded_quant() -> None:
    for module_worst, dmp_worst in run_ranks(2, both, timeout=300):  # one process group
        bad = {case: err for case, err in module_worst.items() if err > 1e-5}
        assert not bad, bad
        assert all(diff < 1e-6 for diff in dmp_worst.values()), dmp_worst


def every_type_plans(ws: int) -> Dict[str, Dict]:
    """Each sharding type the quant EBC sharder offers, alone, at world size `ws` (local
    size `every_type_lws(ws)`); column shards of even widths (INT4 packs two per byte)."""
    last, nodes = ws - 1, ws // every_type_lws(ws)
    names = [t.name for t in tables()]
    return {
        "table_wise": {n: table_wise(i % ws, compute_kernel=Q) for i, n in enumerate(names)},
        "row_wise": {n: row_wise(compute_kernel=Q) for n in names},
        "column_wise": {n: column_wise([last, 0], compute_kernel=Q) for n in names},
        "table_row_wise": {
            n: table_row_wise(i % nodes, compute_kernel=Q) for i, n in enumerate(names)
        },
        "table_column_wise": {
            n: table_column_wise(i % nodes, compute_kernel=Q) for i, n in enumerate(names)
        },
        "data_parallel": {n: data_parallel(compute_kernel=Q) for n in names},
    }


def every_type_lws(ws: int) -> int:
    return 2 if ws % 2 == 0 and ws > 2 else 1


def every_sharding_type(rank: int, ws: int) -> Dict[str, float]:
    """Worst |sharded - unsharded| per (dtype, sharding type, weighted), over two steps."""
    lws = every_type_lws(ws)
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD, local_world_size=lws)
    worst: Dict[str, float] = {}
    for dtype in (torch.qint8, torch.quint4x2):
        for kind, per_table in every_type_plans(ws).items():
            for weighted in (False, True):
                torch.manual_seed(0)
                qebc = QuantEmbeddingBagCollection.from_float(
                    EmbeddingBagCollection(tables(), weighted), dtype
                )
                plan = construct_module_sharding_plan(
                    qebc, per_table, local_size=lws, world_size=ws
                )
                sharded = QuantEmbeddingBagCollectionSharder().shard(qebc, plan, env)
                key = f"{dtype}/{kind}/{'weighted' if weighted else 'unweighted'}"
                for step in range(2):
                    kjt = local_batch(rank, step, 3 if rank == 0 or step == 0 else 2, weighted)
                    if kind == "table_row_wise" and step == 1:
                        kjt = local_batch(rank, step, 3, weighted)  # TWRW: equal batch sizes
                    with torch.no_grad():
                        got, want = sharded(kjt).wait(), qebc(kjt)
                    assert got.keys() == want.keys(), (key, got.keys(), want.keys())
                    error = (got.values() - want.values()).abs().max().item()
                    worst[key] = max(worst.get(key, 0.0), error)
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_quant_every_sharding_type_equals_unsharded(world_size: int) -> None:
    """Every sharding type the quant EBC sharder offers, alone, at world sizes 1-4."""
    for worst in run_ranks(world_size, every_sharding_type, timeout=300):
        assert len(worst) == 2 * 6 * 2, sorted(worst)
        bad = {case: err for case, err in worst.items() if err > 1e-5}
        assert not bad, bad


def test_quant_plans_are_checked_before_sharding() -> None:
    env = ShardingEnv.from_local(2, 0)
    qebc = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(tables()), torch.quint4x2)
    sharder = QuantEmbeddingBagCollectionSharder()
    assert sharder.compute_kernels("row_wise", "cpu") == ["quant"]
    fused = construct_module_sharding_plan(
        qebc,
        {
            "t0": table_wise(0),
            "t1": table_wise(0, compute_kernel=Q),
            "t2": table_wise(1, compute_kernel=Q),
        },
        world_size=2,
    )
    with pytest.raises(ValueError, match=r"table 't0'.*compute_kernel='quant'.*'fused'"):
        sharder.shard(qebc, fused, env)
    odd = construct_module_sharding_plan(
        qebc,
        {
            "t0": table_wise(0, compute_kernel=Q),
            "t1": table_wise(0, compute_kernel=Q),
            "t2": column_wise([0, 1, 0, 1, 0], compute_kernel=Q),
        },
        world_size=2,
    )
    with pytest.raises(ValueError, match=r"table 't2'.*column 4 of width 3.*INT4"):
        sharder.shard(qebc, odd, env)
