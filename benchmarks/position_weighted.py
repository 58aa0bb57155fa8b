"""Position-weighted workload: one training step of a sharded FeatureProcessedEmbeddingBagCollection
(every feature position weighted) against the same step of the weighted EBC fed fixed weights
(the lookups alone) and of the unweighted EBC. The gap is what the position weights cost:
positions computed and carried through the input dist, the gather, its backward, the dense
update of the weights and their DDP all-reduce.

    python -m benchmarks.position_weighted --world-size 2 --sharding row_wise
    python -m benchmarks.position_weighted --quick

Each case runs on fresh gloo ranks (pinned, `--threads` torch threads each): `--warmup`
steps, then `--steps` timed ones; a case's figure is the median step of the slowest rank.
Prints one JSON line per case. Time it alone on the machine (`flock /tmp/recshard-timing.lock`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch
from torch import nn

from benchmarks import ranks
from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from recshard.modules.feature_processor_ import PositionWeightedModuleCollection
from recshard.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recshard.optim import in_backward_optimizer_filter
from recshard.plan.manual import construct_module_sharding_plan, row_wise, table_wise
from recshard.types import ShardingPlan

CASES = ["position_weighted", "weighted_ebc", "unweighted_ebc"]


class _Holder(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.ebc = module

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(features).values()


def _tables(args: argparse.Namespace) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{i}", feature_names=[f"f{i}"]
        )
        for i in range(args.features)
    ]


def _batch(args: argparse.Namespace, rank: int, step: int, weighted: bool) -> KeyedJaggedTensor:
    """Bags of 1..max_length ids per feature and sample (a user's history)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    lengths = torch.randint(1, args.max_length + 1, (args.features * args.batch_size,), generator=g)
    values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    keys = [f"f{i}" for i in range(args.features)]
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)


def _rank_step_times(args: argparse.Namespace, case: str) -> List[float]:
    world_size = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    tables = _tables(args)
    ebc = EmbeddingBagCollection(tables, is_weighted=case != "unweighted_ebc")
    ebc_sharder = EmbeddingBagCollectionSharder({"optimizer": "exact_sgd", "learning_rate": 0.01})
    module: nn.Module = ebc
    sharder = ebc_sharder
    if case == "position_weighted":
        lengths = {f: args.max_length for t in tables for f in t.feature_names}
        module = FeatureProcessedEmbeddingBagCollection(
            ebc, PositionWeightedModuleCollection(lengths)
        )
        sharder = FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder)
    generate = row_wise() if args.sharding == "row_wise" else None
    per_table = {t.name: generate or table_wise(rank=i % world_size) for i, t in enumerate(tables)}
    plan = construct_module_sharding_plan(module, per_table, world_size=world_size)
    model = DistributedModelParallel(
        _Holder(module), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    optimizer = torch.optim.SGD(dense, lr=0.01) if dense else None
    batches = [_batch(args, rank, s, case == "weighted_ebc") for s in range(4)]
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        model(batches[step % len(batches)]).sum().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--features", type=int, default=8, help="one table per feature")
    p.add_argument("--max-length", type=int, default=20, help="ids per bag: 1..max_length")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--sharding", choices=["table_wise", "row_wise"], default="table_wise")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin ranks")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="a small batch and few steps")
    args = p.parse_args()
    if args.quick:
        args.batch_size, args.rows, args.steps, args.warmup = 64, 1000, 3, 1
    for case in CASES:
        per_rank = ranks.run_ranks(args.world_size, args, _rank_step_times, args, case)
        slowest: Dict[str, float] = {
            "median_ms": max(statistics.median(t) for t in per_rank) * 1e3,
            "min_ms": max(min(t) for t in per_rank) * 1e3,
        }
        line = {
            "bench": "position_weighted",
            "case": case,
            "world_size": args.world_size,
            "sharding": args.sharding,
            "batch_size": args.batch_size,
            "features": args.features,
            "max_length": args.max_length,
            "dim": args.dim,
            **{k: round(v, 3) for k, v in slowest.items()},
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
