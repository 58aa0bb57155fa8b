"""Key-value tables (`compute_kernel="key_value"`) == the in-memory fused kernel.

The same EBC sharded twice with one plan kind, once `fused` and once `key_value` with a DRAM
cache of a tenth of each shard, trained for several steps on the same batches: outputs, every
rank's shard weights and fused optimizer state, and the state_dict agree, at world sizes 1
and 2, for table-, row-, column- and table-row-wise plans, SGD and (row-wise) Adagrad, dims not
divisible by 4, with the caches' books kept by the C++ library (`native_row_cache`) and, at
world size 2, by its torch fallback. Bad storage directories fail on every rank before
training.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, List

import pytest
import torch
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from recshard.distributed import EmbeddingBagCollectionSharder, sharded_state
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from recshard.lookup import native_row_cache
from recshard.types import CacheParams, ShardingEnv

LR = 0.1
LOAD_FACTOR = 0.1
ROWS = {"t0": 2000, "t1": 1200, "t2": 1500}


def make_ebc() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=ROWS["t0"], embedding_dim=8, name="t0", feature_names=["f0", "f1"]
            ),
            EmbeddingBagConfig(
                num_embeddings=ROWS["t1"],
                embedding_dim=3,
                name="t1",
                feature_names=["f2"],
                pooling=PoolingType.MEAN,
            ),
            EmbeddingBagConfig(
                num_embeddings=ROWS["t2"], embedding_dim=6, name="t2", feature_names=["f3"]
            ),
        ]
    )


def plan_for(kind: str, ws: int, kernel: str) -> Dict:
    names = ["t0", "t1", "t2"]
    if kind == "table_wise":
        return {n: table_wise(i % ws, compute_kernel=kernel) for i, n in enumerate(names)}
    if kind == "row_wise":
        return {n: row_wise(compute_kernel=kernel) for n in names}
    if kind == "column_wise":
        ranks = list(range(ws)) if ws > 1 else [0, 0]
        return {n: column_wise(ranks, compute_kernel=kernel) for n in names}
    if kind == "table_row_wise":
        return {n: table_row_wise(0, compute_kernel=kernel) for n in names}
    raise ValueError(kind)


def batch(rank: int, step: int) -> KeyedJaggedTensor:
    """Zipf-like ids (a few hot rows, a long tail), 8 bags per feature, up to 3 ids a bag."""
    g = torch.Generator().manual_seed(100 * step + rank)
    keys = ["f0", "f1", "f2", "f3"]
    rows = [ROWS["t0"], ROWS["t0"], ROWS["t1"], ROWS["t2"]]
    lengths = torch.randint(0, 4, (len(keys), 8), generator=g)
    values = []
    for i, n in enumerate(rows):
        u = torch.rand(int(lengths[i].sum()), generator=g)
        values.append((n**u - 1).long().clamp(max=n - 1))
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values), lengths.reshape(-1))


def _shard(kind: str, kernel: str, ws: int, optimizer: str, directory: str | None):
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    reference = make_ebc()
    plan = construct_module_sharding_plan(reference, plan_for(kind, ws, kernel), world_size=ws)
    fused = {"optimizer": optimizer, "learning_rate": LR}
    if directory is not None:
        fused["ssd_storage_directory"] = directory
        for sharding in plan.values():
            sharding.cache_params = CacheParams(load_factor=LOAD_FACTOR)
    return EmbeddingBagCollectionSharder(fused_params=fused).shard(reference, plan, env)


def run_case(
    rank: int, ws: int, kind: str, optimizer: str, steps: int, base: str, books: str = "native"
) -> List[str]:
    problems: List[str] = []
    directory = tempfile.mkdtemp(prefix=f"{kind}-{optimizer}-{rank}-", dir=base)
    fused = _shard(kind, "fused", ws, optimizer, None)
    kv = _shard(kind, "key_value", ws, optimizer, directory)
    caches = [c for s in kv.shardings.values() for k in s.lookup.kernels for c in k.caches]
    if {c.native for c in caches} != {books == "native"}:
        problems.append(f"caches' books not kept by {books}")
    for step in range(steps):
        features = batch(rank, step)
        out, kv_out = fused(features).values(), kv(features).values()
        if not torch.allclose(out, kv_out, atol=1e-6):
            problems.append(f"step {step}: forward differs by {(out - kv_out).abs().max():.3g}")
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        (out * grad).sum().backward()
        (kv_out * grad).sum().backward()
    for name, shards in fused.local_table_shards().items():
        kv_shards = kv.local_table_shards()[name]
        for (table, weight), (_, kv_weight) in zip(shards, kv_shards):
            if not torch.allclose(weight, kv_weight, atol=1e-6):
                problems.append(f"{name}@{table.row_offset},{table.col_offset}: weights differ")
    kv_states = kv.fused_optimizer_states()
    for name, shards in fused.fused_optimizer_states().items():
        for (table, states), (_, kv_state) in zip(shards, kv_states[name]):
            for state_name, value in states.items():
                if not torch.allclose(value, kv_state[state_name], atol=1e-6):
                    problems.append(f"{name}@{table.row_offset}: {state_name} differs")
    state, kv_state = _tables(fused.state_dict()), _tables(kv.state_dict())
    if list(state) != list(kv_state):
        problems.append(f"state_dict keys {list(kv_state)} != {list(state)}")
    for key, value in state.items():
        if not torch.allclose(_local(value), _local(kv_state[key]), atol=1e-6, equal_nan=True):
            problems.append(f"state_dict {key} differs")
    hit_rates = [k.hit_rate() for s in kv.shardings.values() for k in s.lookup.kernels]
    # the DRAM tier missed (it is smaller than the rows used); with every row on one rank
    # the hot rows hit as well (row-wise, a rank may hold only cold rows)
    if not all(rate < 1.0 for rate in hit_rates) or (ws == 1 and min(hit_rates) == 0.0):
        problems.append(f"the cache should both hit and miss: hit rates {hit_rates}")
    return problems


def _tables(state: Dict) -> Dict:
    return {k: v for k, v in state.items() if k.startswith("embedding_bags.")}


def _local(value) -> torch.Tensor:  # noqa: ANN001
    """A state_dict value with this rank's pieces in place, NaN elsewhere (ShardedTensor;
    DTensor and tensors as they are)."""
    if hasattr(value, "to_local"):
        return value.to_local()
    if not hasattr(value, "local_shards"):
        return value
    full = torch.full(value.size(), float("nan"))
    for shard in value.local_shards():
        region = full
        for dim, (offset, size) in enumerate(
            zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
        ):
            region = region.narrow(dim, offset, size)
        region.copy_(shard.tensor)
    return full


def run_all(rank: int, ws: int, cases: List, base: str, books: str = "native") -> List[str]:
    sharded_state.KEY_VALUE_PIECE_BYTES = 1024  # state dicts cut shards into many pieces
    if books == "torch":  # this rank process keeps the caches' books in torch
        native_row_cache.available = lambda: False
    return [f"{case}: {p}" for case in cases for p in run_case(rank, ws, *case, 5, base, books)]


KINDS = ["table_wise", "row_wise", "column_wise", "table_row_wise"]
OPTIMIZERS = ["exact_sgd", "exact_row_wise_adagrad", "exact_adagrad"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_key_value_equals_fused(world_size: int, tmp_path) -> None:  # noqa: ANN001
    """Each sharding type once, each optimizer at least once."""
    cases = [(kind, OPTIMIZERS[i % len(OPTIMIZERS)]) for i, kind in enumerate(KINDS)]
    for problems in run_ranks(world_size, run_all, cases, str(tmp_path), timeout=600):
        assert problems == []


def test_key_value_equals_fused_with_books_in_torch(tmp_path) -> None:  # noqa: ANN001
    """The same cases with the C++ row cache library taken away (its fallback)."""
    cases = [(kind, OPTIMIZERS[i % len(OPTIMIZERS)]) for i, kind in enumerate(KINDS)]
    for problems in run_ranks(2, run_all, cases, str(tmp_path), "torch", timeout=600):
        assert problems == []


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_key_value_equals_fused_every_optimizer(world_size: int, tmp_path) -> None:  # noqa: ANN001
    cases = [(kind, optimizer) for kind in KINDS for optimizer in OPTIMIZERS]
    for problems in run_ranks(world_size, run_all, cases, str(tmp_path), timeout=600):
        assert problems == []


def _bad_directory(rank: int, ws: int, directory: str, good: str) -> str:
    """Rank 1 gets `directory`, rank 0 `good`; returns the error this rank raised."""
    try:
        _shard("row_wise", "key_value", ws, "exact_sgd", directory if rank == 1 else good)
    except ValueError as e:
        return str(e)
    return "no error"


def test_bad_directory_fails_on_every_rank(tmp_path) -> None:  # noqa: ANN001
    missing = str(tmp_path / "absent")
    for message in run_ranks(2, _bad_directory, missing, str(tmp_path)):
        assert "rank 1" in message and "is not a directory" in message and "absent" in message


def _left_behind(rank: int, ws: int, directory: str) -> str:
    _shard("table_wise", "key_value", ws, "exact_sgd", directory)
    try:
        _shard("table_wise", "key_value", ws, "exact_sgd", directory)
    except ValueError as e:
        return str(e)
    return "no error"


def test_existing_files_are_never_reused(tmp_path) -> None:  # noqa: ANN001
    directory = str(tmp_path)
    (message,) = run_ranks(1, _left_behind, directory)
    assert "table 't0'" in message and "already exists" in message
    modes = {os.stat(os.path.join(directory, f)).st_mode & 0o777 for f in os.listdir(directory)}
    assert modes == {0o600}


def _too_big(rank: int, ws: int, directory: str) -> str:
    """A table of ~1 PB (on `meta`) planned key_value: the space check fails before any file."""
    config = EmbeddingBagConfig(
        num_embeddings=1 << 40, embedding_dim=256, name="huge", feature_names=["f"]
    )
    module = EmbeddingBagCollection([config], device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        module, {"huge": row_wise(compute_kernel="key_value")}, world_size=ws
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    fused = {"optimizer": "exact_sgd", "ssd_storage_directory": directory}
    try:
        EmbeddingBagCollectionSharder(fused_params=fused).shard(module, plan, env)
    except ValueError as e:
        return str(e)
    return "no error"


def test_no_space_fails_on_every_rank_before_any_file(tmp_path) -> None:  # noqa: ANN001
    for message in run_ranks(2, _too_big, str(tmp_path)):
        assert "rank 0" in message and "huge" in message and "only" in message, message
    assert os.listdir(tmp_path) == []
