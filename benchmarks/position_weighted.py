"""Position-weighted workload: one training step of a sharded FeatureProcessedEmbeddingBagCollection
(every feature position weighted) against the same step of the weighted EBC fed fixed weights
(the lookups alone) and of the unweighted EBC. The gap is what the position weights cost:
positions computed and carried through the input dist, the gather, its backward, the dense
update of the weights and their DDP all-reduce.

    python -m benchmarks.position_weighted --world-size 2 --sharding row_wise
    python -m benchmarks.position_weighted --quick

    python -m benchmarks.position_weighted --venv /tmp/torchrec-venv   # TorchRec beside it

Each case runs on fresh gloo ranks (pinned, `--threads` torch threads each): `--warmup`
steps, then `--steps` timed ones; a run's figure is the median step of the slowest rank, a
case's the median over `--repeats` interleaved runs (`benchmarks/sparse_workloads.py`; with
`--venv`, TorchRec's side runs the same batches in the same loop). JSON lines. Time it alone
on the machine (`flock /tmp/recshard-timing.lock`).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.sparse_workloads import (
    BATCHES,
    Step,
    add_run_arguments,
    position_weighted_batch,
    run,
)
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


def build(cfg: Dict[str, Any], case: str) -> Step:
    """recshard's model for `case` under DMP (fused SGD tables, dense SGD on the position
    weights) and its training step."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tables = [
        EmbeddingBagConfig(
            num_embeddings=cfg["rows"],
            embedding_dim=cfg["dim"],
            name=f"t{i}",
            feature_names=[f"f{i}"],
        )
        for i in range(cfg["features"])
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=case != "unweighted_ebc")
    ebc_sharder = EmbeddingBagCollectionSharder({"optimizer": "exact_sgd", "learning_rate": 0.01})
    module: nn.Module = ebc
    sharder = ebc_sharder
    if case == "position_weighted":
        lengths = {f: cfg["max_length"] for t in tables for f in t.feature_names}
        module = FeatureProcessedEmbeddingBagCollection(
            ebc, PositionWeightedModuleCollection(lengths)
        )
        sharder = FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder)
    generate = row_wise() if cfg["sharding"] == "row_wise" else None
    per_table = {t.name: generate or table_wise(rank=i % world_size) for i, t in enumerate(tables)}
    plan = construct_module_sharding_plan(module, per_table, world_size=world_size)
    model = DistributedModelParallel(
        _Holder(module), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    optimizer = torch.optim.SGD(dense, lr=0.01) if dense else None
    batches = []
    for s in range(BATCHES):
        parts = position_weighted_batch(cfg, rank, s, case == "weighted_ebc")
        batches.append(
            KeyedJaggedTensor.from_lengths_sync(
                parts["keys"], parts["values"], parts["lengths"], parts["weights"]
            )
        )

    def step(i: int) -> None:
        model(batches[i % len(batches)]).sum().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(p)
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--features", type=int, default=8, help="one table per feature")
    p.add_argument("--max-length", type=int, default=20, help="ids per bag: 1..max_length")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args()
    if args.quick:
        args.batch_size, args.rows, args.steps, args.warmup, args.repeats = 64, 1000, 3, 1, 1
    run("position_weighted", CASES, args, "batch_size features max_length rows dim", build)


if __name__ == "__main__":
    main()
