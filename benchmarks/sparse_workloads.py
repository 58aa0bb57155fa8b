"""The VBE and position-weighted workloads, their timing loop and their side-by-side driver.

Plain torch on purpose: `benchmarks/vbe.py`, `benchmarks/position_weighted.py` and TorchRec's
side (`benchmarks/torchrec_sparse.py.txt`, run by a TorchRec venv's python) all import it, so
both libraries see the same batches (as plain tensors, each side builds its own
`KeyedJaggedTensor`) and are timed by the same loop on the same fresh rank processes.

A side supplies `build(cfg, case) -> step(i)`: one training step on batch `i` of this rank.
`rank_times` warms it up and times it; `drive` runs every case for every side in turn (A B A B
A B, fresh ranks each run) and prints one JSON line per run and one per case with the medians
over repeats.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch

from benchmarks.ranks import run_ranks, timed_steps, warm_up
from benchmarks.torchrec_server import TorchRecServer, emit

Step = Callable[[int], None]
Build = Callable[[Dict[str, Any], str], Step]
BATCHES = 4  # distinct batches each side cycles through
TORCHREC_SIDE = Path(__file__).with_name("torchrec_sparse.py.txt")


def vbe_keys(cfg: Dict[str, Any]) -> tuple[List[str], List[str]]:
    """The user features and the item features."""
    return (
        [f"user_{i}" for i in range(cfg["user_features"])],
        [f"item_{i}" for i in range(cfg["item_features"])],
    )


def vbe_batch(cfg: Dict[str, Any], rank: int, step: int, case: str) -> Dict[str, Any]:
    """One rank's ranking batch: the user's history bags (`user_length` ids) once, each item's
    bags (`item_length` ids) per candidate. "vbe": a variable batch (strides [[1]] for users,
    [[items]] for items, and `inverse_indices`); "expanded": the user bags repeated for every
    candidate. Keys `keys, values, lengths, stride_per_key_per_rank, inverse_indices`."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    users, items = vbe_keys(cfg)
    n = cfg["items"]
    user_ids = [torch.randint(0, cfg["rows"], (cfg["user_length"],), generator=g) for _ in users]
    item_ids = [
        torch.randint(0, cfg["rows"], (n * cfg["item_length"],), generator=g) for _ in items
    ]
    item_lengths = torch.full((n,), cfg["item_length"])
    if case == "expanded":
        lengths = torch.full((len(users) * n,), cfg["user_length"])
        return dict(
            keys=users + items,
            values=torch.cat([ids.repeat(n) for ids in user_ids] + item_ids),
            lengths=torch.cat([lengths] + [item_lengths] * len(items)),
            stride_per_key_per_rank=None,
            inverse_indices=None,
        )
    inverse = torch.cat(
        [
            torch.zeros(len(users), n, dtype=torch.long),
            torch.arange(n).expand(len(items), n),
        ]
    )
    return dict(
        keys=users + items,
        values=torch.cat(user_ids + item_ids),
        lengths=torch.cat(
            [torch.tensor([cfg["user_length"]])] * len(users) + [item_lengths] * len(items)
        ),
        stride_per_key_per_rank=[[1]] * len(users) + [[n]] * len(items),
        inverse_indices=(users + items, inverse),
    )


def position_weighted_batch(
    cfg: Dict[str, Any], rank: int, step: int, weighted: bool
) -> Dict[str, Any]:
    """Bags of 1..max_length ids per feature and sample (a user's history); random per-id
    weights if `weighted`. Keys `keys, values, lengths, weights`."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    lengths = torch.randint(
        1, cfg["max_length"] + 1, (cfg["features"] * cfg["batch_size"],), generator=g
    )
    values = torch.randint(0, cfg["rows"], (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    keys = [f"f{i}" for i in range(cfg["features"])]
    return dict(keys=keys, values=values, lengths=lengths, weights=weights)


def rank_times(build: Build, cfg: Dict[str, Any], case: str) -> List[float]:
    """This rank's seconds per timed step: `build`, `warmup` steps, a barrier, `steps` steps."""
    torch.manual_seed(0)
    step = build(cfg, case)
    warm_up(step, cfg["warmup"])
    return timed_steps(lambda i: step(cfg["warmup"] + i), cfg["steps"])


def slowest_median_ms(per_rank: List[List[float]]) -> float:
    """A run's figure: the median over steps of the slowest rank's step, in ms."""
    return 1e3 * statistics.median(max(step) for step in zip(*per_rank))


def drive(
    bench: str,
    cases: Sequence[str],
    args: argparse.Namespace,
    cfg: Dict[str, Any],
    build: Build,
    torchrec: Any | None,
    command: str,
) -> None:
    """Every case `args.repeats` times, recshard's ranks then TorchRec's (`torchrec`: a
    `TorchRecServer`, or None for recshard alone)."""
    emit(
        dict(
            bench=f"{bench}_setup",
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=command,
            load_average=[round(x, 2) for x in os.getloadavg()],
            world_size=args.world_size,
            repeats=args.repeats,
            **cfg,
        )
    )
    sides = ["recshard"] + ([] if torchrec is None else ["torchrec"])
    runs: Dict[str, Dict[str, List[float]]] = {c: {s: [] for s in sides} for c in cases}
    errors: Dict[str, str] = {}
    for _ in range(args.repeats):
        for case in cases:
            for side in sides:
                if side == "torchrec" and case in errors:
                    continue  # it failed once: the same run fails again
                try:
                    per_rank = _run(side, bench, case, args, cfg, build, torchrec)
                except RuntimeError as e:  # TorchRec's side failing is a result too
                    if side == "recshard":
                        raise
                    errors[case] = str(e).splitlines()[-1][-300:]
                    emit(dict(bench=f"{bench}_run", library=side, case=case, error=errors[case]))
                    continue
                ms = slowest_median_ms(per_rank)
                runs[case][side].append(ms)
                emit(dict(bench=f"{bench}_run", library=side, case=case, median_ms=round(ms, 3)))
    for case, by_side in runs.items():
        record: Dict[str, Any] = dict(bench=bench, case=case, world_size=args.world_size)
        for side, times in by_side.items():
            record[f"{side}_median_ms"] = round(statistics.median(times), 3) if times else None
            record[f"{side}_repeats_ms"] = [round(t, 3) for t in times]
        if case in errors:
            record["torchrec_error"] = errors[case]
        elif torchrec is not None:
            record["ratio"] = round(record["torchrec_median_ms"] / record["recshard_median_ms"], 3)
        emit(record)


def _run(
    side: str,
    bench: str,
    case: str,
    args: argparse.Namespace,
    cfg: Dict[str, Any],
    build: Build,
    torchrec: Any | None,
) -> List[List[float]]:
    """Every rank's step times of one run of `case` on `side`'s fresh ranks."""
    if side == "recshard":
        return run_ranks(args.world_size, args, rank_times, build, cfg, case)
    request = dict(
        bench=bench,
        case=case,
        cfg=cfg,
        world_size=args.world_size,
        threads=args.threads,
        pin=args.pin,
        timeout=args.timeout,
    )
    return torchrec.run(request)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every side-by-side sparse benchmark takes."""
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sharding", choices=["table_wise", "row_wise"], default="table_wise")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per case and side")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin ranks")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--venv", default=None, help="a venv with TorchRec: time its side too")
    p.add_argument("--quick", action="store_true", help="a small batch and few steps")


def run(
    bench: str, cases: Sequence[str], args: argparse.Namespace, keys: str, build: Build
) -> None:
    """The benchmark's command line: `keys` (space-separated argument names) make the cfg the
    builds read; with `--venv`, TorchRec's side runs beside recshard's."""
    names = ["sharding", *keys.split(), "steps", "warmup", "threads"]
    cfg = {k: getattr(args, k) for k in names}
    server = None if args.venv is None else TorchRecServer(Path(args.venv), TORCHREC_SIDE)
    try:
        command = " ".join([f"python -m benchmarks.{bench}", *sys.argv[1:]])
        drive(bench, cases, args, cfg, build, server, command)
    finally:
        if server is not None:
            server.close()
