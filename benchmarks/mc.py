"""Managed collision step cost: the sharded MC-EBC against the plain sharded EBC (row-wise, the
same tables), on 26 one-feature tables fed raw 64-bit ids (uniform or Zipf). Prints one JSON
line per distribution (rank 0): median step ms of each, the overhead, the remap's share of
the MC step, and the hit rate and evictions of the last steps.

    python -m benchmarks.mc --world-size 2 [--rows 10000 --batch 512 --steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, List

import torch
import torch.distributed as dist

from benchmarks.launch import run_on_ranks
from recshard.distributed import DistributedModelParallel
from recshard.distributed.embeddingbag import EmbeddingBagCollectionSharder
from recshard.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from recshard.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recshard.modules import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recshard.modules.mc_modules import (
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recshard.sparse import KeyedJaggedTensor

TABLES, DIM, POOLING = 26, 64, 4
FUSED = {"optimizer": "exact_sgd", "learning_rate": 0.01}


def _raw_ids(gen: torch.Generator, n: int, zipf: bool) -> torch.Tensor:
    if not zipf:
        return torch.randint(0, 2**62, (n,), generator=gen)
    rank = torch.rand(n, generator=gen).mul(-torch.log(torch.tensor(1e6))).exp()  # ~1/x
    return (1.0 / rank).long() * 2_654_435_761 % (2**62)


def _batches(args: argparse.Namespace, zipf: bool) -> List[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(dist.get_rank())
    keys = [f"f{t}" for t in range(TABLES)]
    lengths = torch.full((TABLES * args.batch,), POOLING)
    return [
        KeyedJaggedTensor.from_lengths_sync(keys, _raw_ids(gen, int(lengths.sum()), zipf), lengths)
        for _ in range(args.steps + 3)
    ]


def _tables(rows: int) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(rows, DIM, name=f"t{t}", feature_names=[f"f{t}"]) for t in range(TABLES)
    ]


def _time(step: Callable[[KeyedJaggedTensor], None], batches: List[KeyedJaggedTensor]) -> float:
    for kjt in batches[:3]:
        step(kjt)
    times = []
    for kjt in batches[3:]:
        dist.barrier()
        start = time.perf_counter()
        step(kjt)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _measure(args: argparse.Namespace, zipf: bool) -> None:
    """One JSON line (rank 0) for one id distribution."""
    batches = _batches(args, zipf)
    plain = DistributedModelParallel(
        EmbeddingBagCollection(_tables(args.rows)),
        sharders=[EmbeddingBagCollectionSharder(FUSED)],
    )
    folded = [
        KeyedJaggedTensor.from_lengths_sync(b.keys(), b.values() % args.rows, b.lengths())
        for b in batches
    ]
    plain_ms = _time(lambda kjt: plain(kjt).values().sum().backward(), folded)
    tables = _tables(args.rows)
    mcc = ManagedCollisionCollection(
        {
            t.name: MCHManagedCollisionModule(
                args.rows,
                "cpu",
                LFU_EvictionPolicy(),
                args.interval,
                buckets=dist.get_world_size(),
            )
            for t in tables
        },
        tables,
    )
    model = DistributedModelParallel(
        ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), mcc),
        sharders=[ManagedCollisionEmbeddingBagCollectionSharder(fused_params=FUSED)],
    )
    sharded = next(
        m for m in model.modules() if isinstance(m, BaseShardedManagedCollisionEmbeddingCollection)
    )
    remap = sharded._managed_collision_collection.remap
    remap_ms: List[float] = []

    def timed_remap(*a, **k):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        out = remap(*a, **k)
        remap_ms.append((time.perf_counter() - start) * 1e3)
        return out

    sharded._managed_collision_collection.remap = timed_remap
    mc_ms = _time(lambda kjt: model(kjt)[0].values().sum().backward(), batches)
    metrics = [m.metrics() for m in sharded._managed_collision_collection.local_modules().values()]
    if dist.get_rank() == 0:
        lookups = sum(m["lookups"] for m in metrics)
        print(
            json.dumps(
                {
                    "bench": "mc_step",
                    "ids": "zipf" if zipf else "uniform",
                    "world_size": dist.get_world_size(),
                    "tables": TABLES,
                    "rows": args.rows,
                    "batch_per_rank": args.batch,
                    "eviction_interval": args.interval,
                    "plain_ebc_step_ms": round(plain_ms, 3),
                    "mc_ebc_step_ms": round(mc_ms, 3),
                    "overhead": round(mc_ms / plain_ms - 1, 3),
                    "remap_share_of_mc_step": round(statistics.median(remap_ms[3:]) / mc_ms, 3),
                    "hit_rate_rank0": round(sum(m["hits"] for m in metrics) / lookups, 3),
                    "evicted_rank0": sum(int(m["evicted"]) for m in metrics),
                }
            ),
            flush=True,
        )


def main(args: argparse.Namespace) -> None:
    for zipf in (False, True):
        _measure(args, zipf)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=1)
    parsed = parser.parse_args()
    run_on_ranks(main, parsed, parsed.world_size)
