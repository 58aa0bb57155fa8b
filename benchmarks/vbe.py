"""Variable batch per feature (VBE): one training step of a sharded EmbeddingBagCollection on
a ranking batch (per rank: 1 user row of `--user-features` features beside `--items` candidate
rows of `--item-features` features) sent as a variable batch (`stride_per_key_per_rank` +
`inverse_indices`), against the same step with the user features expanded to the full batch
(each user bag copied once per item: what a fixed-batch model has to send and look up). The
two outputs are checked equal before timing. The gap is what VBE saves: user ids routed and
pooled once instead of `--items` times, and their pooled rows sent back once.

    python -m benchmarks.vbe --world-size 2 --sharding table_wise
    python -m benchmarks.vbe --quick

Each case runs on fresh gloo ranks (pinned, `--threads` torch threads each): `--warmup`
steps, then `--steps` timed ones; a case's figure is the median step of the slowest rank.
Prints one JSON line per case (with the command and the date). Time it alone on the machine:
`flock /tmp/recshard-timing.lock python -m benchmarks.vbe`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import List, Tuple

import torch
import torch.distributed as dist

from benchmarks import ranks
from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.plan.manual import construct_module_sharding_plan, row_wise, table_wise
from recshard.types import ShardingEnv

CASES = ["vbe", "expanded"]


def _keys(args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    return (
        [f"user_{i}" for i in range(args.user_features)],
        [f"item_{i}" for i in range(args.item_features)],
    )


def _tables(args: argparse.Namespace) -> List[EmbeddingBagConfig]:
    users, items = _keys(args)
    return [
        EmbeddingBagConfig(
            num_embeddings=args.rows, embedding_dim=args.dim, name=f"t_{k}", feature_names=[k]
        )
        for k in users + items
    ]


def _batch(args: argparse.Namespace, rank: int, step: int, case: str) -> KeyedJaggedTensor:
    """The user's history bags (`--user-length` ids) once, each item's bags (`--item-length`
    ids) per candidate; "expanded": the user bags repeated for every candidate."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    users, items = _keys(args)
    user_ids = [torch.randint(0, args.rows, (args.user_length,), generator=g) for _ in users]
    item_ids = [
        torch.randint(0, args.rows, (args.items * args.item_length,), generator=g) for _ in items
    ]
    item_lengths = torch.full((args.items,), args.item_length)
    if case == "expanded":
        values = torch.cat([ids.repeat(args.items) for ids in user_ids] + item_ids)
        lengths = torch.full((len(users) * args.items,), args.user_length)
        lengths = torch.cat([lengths] + [item_lengths] * len(items))
        return KeyedJaggedTensor(users + items, values, lengths=lengths)
    lengths = torch.cat(
        [torch.tensor([args.user_length])] * len(users) + [item_lengths] * len(items)
    )
    inverse = torch.cat(
        [
            torch.zeros(len(users), args.items, dtype=torch.long),
            torch.arange(args.items).expand(len(items), args.items),
        ]
    )
    return KeyedJaggedTensor(
        users + items,
        torch.cat(user_ids + item_ids),
        lengths=lengths,
        stride_per_key_per_rank=[[1]] * len(users) + [[args.items]] * len(items),
        inverse_indices=(users + items, inverse),
    )


def _rank_step_times(args: argparse.Namespace, case: str) -> List[float]:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    tables = _tables(args)
    ebc = EmbeddingBagCollection(tables)
    sharder = EmbeddingBagCollectionSharder({"optimizer": "exact_sgd", "learning_rate": 0.01})
    per_table = {
        t.name: row_wise() if args.sharding == "row_wise" else table_wise(rank=i % world_size)
        for i, t in enumerate(tables)
    }
    plan = construct_module_sharding_plan(ebc, per_table, world_size=world_size)
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_process_group(dist.group.WORLD))
    batches = [_batch(args, rank, s, case) for s in range(4)]
    with torch.no_grad():  # both forms give the same output
        got = sharded(batches[0]).values()
        want = sharded(_batch(args, rank, 0, "expanded" if case == "vbe" else "vbe")).values()
        if not torch.allclose(got, want, atol=1e-5):
            raise AssertionError(f"{case}: output differs from the other form's")
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        sharded(batches[step % len(batches)]).values().sum().backward()
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--items", type=int, default=2048, help="candidate rows per rank")
    p.add_argument("--user-features", type=int, default=8)
    p.add_argument("--item-features", type=int, default=4)
    p.add_argument("--user-length", type=int, default=50, help="ids per user bag")
    p.add_argument("--item-length", type=int, default=1, help="ids per item bag")
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
        args.items, args.rows, args.steps, args.warmup = 64, 1000, 3, 1
    command = " ".join(["python -m benchmarks.vbe", *sys.argv[1:]])
    for case in CASES:
        per_rank = ranks.run_ranks(args.world_size, args, _rank_step_times, args, case)
        line = {
            "bench": "vbe",
            "case": case,
            "world_size": args.world_size,
            "sharding": args.sharding,
            "items": args.items,
            "user_features": args.user_features,
            "item_features": args.item_features,
            "user_length": args.user_length,
            "item_length": args.item_length,
            "dim": args.dim,
            "threads": args.threads,
            "median_ms": round(max(statistics.median(t) for t in per_rank) * 1e3, 3),
            "min_ms": round(max(min(t) for t in per_rank) * 1e3, 3),
            "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
