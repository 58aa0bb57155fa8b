"""A key-value table several times its DRAM budget trains with resident memory (VmRSS from
/proc) under that budget: the table (built on `meta`, initialized on storage in chunks) never
sits in memory, only its cache and row map do."""

from __future__ import annotations

from typing import Dict

import torch
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recshard.lookup.fused_params import parse_fused_params
from recshard.lookup.key_value import dram_bytes
from recshard.types import ShardingEnv

ROWS, DIM = 500_000, 64  # 128 MB of weights
MB = 1 << 20
STEP_IDS = 256 * 4  # a step's ids: at most this many distinct rows
# what a step itself holds besides the cache: ids, pooled outputs, gradients, allocator slack
STEP_SLACK = 24 * MB


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def train(rank: int, ws: int, directory: str) -> Dict[str, float]:
    fused = {
        "optimizer": "exact_row_wise_adagrad",
        "learning_rate": 0.05,
        "ssd_storage_directory": directory,
        "cache_load_factor": 0.05,
    }
    config = EmbeddingBagConfig(
        num_embeddings=ROWS, embedding_dim=DIM, name="big", feature_names=["f"]
    )
    module = EmbeddingBagCollection([config], device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        module, {"big": table_wise(0, compute_kernel="key_value")}, world_size=ws
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    baseline = rss()
    sharded = EmbeddingBagCollectionSharder(fused_params=fused).shard(module, plan, env)
    (kernel,) = [k for s in sharded.shardings.values() for k in s.lookup.kernels]
    budget = dram_bytes(kernel.tables[0], parse_fused_params(fused, "big"), STEP_IDS)
    peak = rss() - baseline
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        ids = (ROWS ** torch.rand(STEP_IDS, generator=g) - 1).long()
        features = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.full((256,), 4))
        out = sharded(features).values()
        out.pow(2).sum().backward()
        peak = max(peak, rss() - baseline)
    return {"peak": peak, "budget": budget, "table": ROWS * DIM * 4, "hit": kernel.hit_rate()}


def test_resident_memory_stays_under_the_dram_budget(tmp_path) -> None:  # noqa: ANN001
    (result,) = run_ranks(1, train, str(tmp_path), timeout=300)
    assert result["table"] > 6 * result["budget"]
    assert result["peak"] < result["budget"] + STEP_SLACK, result
    assert 0.0 < result["hit"] < 1.0, result
