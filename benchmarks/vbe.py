"""Variable batch per feature (VBE): one training step of a sharded EmbeddingBagCollection on
a ranking batch (per rank: 1 user row of `--user-features` features beside `--items` candidate
rows of `--item-features` features) sent as a variable batch (`stride_per_key_per_rank` +
`inverse_indices`), against the same step with the user features expanded to the full batch
(each user bag copied once per item: what a fixed-batch model has to send and look up). The
two outputs are checked equal before timing. The gap is what VBE saves: user ids routed and
pooled once instead of `--items` times, and their pooled rows sent back once.

    python -m benchmarks.vbe --world-size 2 --sharding table_wise
    python -m benchmarks.vbe --quick

    python -m benchmarks.vbe --venv /tmp/torchrec-venv      # TorchRec's sharded EBC beside it

Each case runs on fresh gloo ranks (pinned, `--threads` torch threads each): `--warmup`
steps, then `--steps` timed ones; a run's figure is the median step of the slowest rank, a
case's the median over `--repeats` interleaved runs (`benchmarks/sparse_workloads.py`; with
`--venv`, TorchRec's side runs the same batches in the same loop). JSON lines. Time it alone
on the machine: `flock /tmp/recshard-timing.lock python -m benchmarks.vbe`.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import torch
import torch.distributed as dist

from benchmarks.sparse_workloads import BATCHES, Step, add_run_arguments, run, vbe_batch, vbe_keys
from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.plan.manual import construct_module_sharding_plan, row_wise, table_wise
from recshard.types import ShardingEnv

CASES = ["vbe", "expanded"]


def _kjt(parts: Dict[str, Any]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        parts["keys"],
        parts["values"],
        lengths=parts["lengths"],
        stride_per_key_per_rank=parts["stride_per_key_per_rank"],
        inverse_indices=parts["inverse_indices"],
    )


def build(cfg: Dict[str, Any], case: str) -> Step:
    """recshard's sharded EBC (fused SGD) and its training step on `case`'s batches; checks
    first that both forms of a batch give the same output."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    users, items = vbe_keys(cfg)
    tables = [
        EmbeddingBagConfig(
            num_embeddings=cfg["rows"], embedding_dim=cfg["dim"], name=f"t_{k}", feature_names=[k]
        )
        for k in users + items
    ]
    ebc = EmbeddingBagCollection(tables)
    sharder = EmbeddingBagCollectionSharder({"optimizer": "exact_sgd", "learning_rate": 0.01})
    per_table = {
        t.name: row_wise() if cfg["sharding"] == "row_wise" else table_wise(rank=i % world_size)
        for i, t in enumerate(tables)
    }
    plan = construct_module_sharding_plan(ebc, per_table, world_size=world_size)
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD))
    batches = [_kjt(vbe_batch(cfg, rank, s, case)) for s in range(BATCHES)]
    other = _kjt(vbe_batch(cfg, rank, 0, "expanded" if case == "vbe" else "vbe"))
    with torch.no_grad():
        if not torch.allclose(sharded(batches[0]).values(), sharded(other).values(), atol=1e-5):
            raise AssertionError(f"{case}: output differs from the other form's")

    def step(i: int) -> None:
        sharded(batches[i % len(batches)]).values().sum().backward()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(p)
    p.add_argument("--items", type=int, default=2048, help="candidate rows per rank")
    p.add_argument("--user-features", type=int, default=8)
    p.add_argument("--item-features", type=int, default=4)
    p.add_argument("--user-length", type=int, default=50, help="ids per user bag")
    p.add_argument("--item-length", type=int, default=1, help="ids per item bag")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args()
    if args.quick:
        args.items, args.rows, args.steps, args.warmup, args.repeats = 64, 1000, 3, 1, 1
    run(
        "vbe",
        CASES,
        args,
        "items user_features item_features user_length item_length rows dim",
        build,
    )


if __name__ == "__main__":
    main()
