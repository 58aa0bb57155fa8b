"""Unsharded EBC / EC step (forward + backward, optionally + Adam) in one process, on several
table sets. Prints one JSON line per (module, table set).

    python -m benchmarks.modules                 # recshard, every table set
    python -m benchmarks.modules --quick         # two table sets, smaller batches, fewer steps
    python -m benchmarks.modules --api torchrec  # the same work through another library
                                                 # with TorchRec's names (run it from that
                                                 # library's venv, e.g. /tmp/torchrec-venv)
    python -m benchmarks.modules --compare /tmp/torchrec-venv/bin/python:torchrec --repeats 3
    python -m benchmarks.modules --compare /tmp/torchrec-venv/bin/python:torchrec \
        before=.venv/bin/python:recshard@/tmp/recshard-main   # also an older checkout

`--api` names a module exposing EmbeddingBagCollection, EmbeddingBagConfig,
EmbeddingCollection, EmbeddingConfig and KeyedJaggedTensor (recshard's top level does);
nothing here depends on any other library. `--compare SIDE...` runs this file's work in
fresh processes (one per table set), alternating recshard (this interpreter) and each side,
`--repeats` times (A B A B ...), prints every run's lines, then one `module_compare` line per
(module, table set) with the median over repeats of each side and `ratio_to_X` = recshard / X (< 1:
recshard faster). Absolute times on a shared machine drift between runs; the ratio of
interleaved runs is the figure to quote.
Seeds are fixed; `median_step_ms` is the median over `--steps` timed steps after a warm-up.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Callable, Dict, List, Tuple

import torch

# Criteo-like: 26 one-feature tables, the rows of its 26 categorical features capped at 10 k
# (the dense optimizer's pass over every row, the same in any library, would hide the rest)
CRITEO_ROWS = [
    1460,
    583,
    10000,
    10000,
    305,
    24,
    10000,
    633,
    3,
    10000,
    5683,
    10000,
    3194,
    27,
    10000,
    10000,
    10,
    5652,
    2173,
    4,
    10000,
    18,
    15,
    10000,
    105,
    10000,
]


@dataclass(frozen=True)
class TableSet:
    name: str
    rows: List[int]  # one table per entry
    features_per_table: int  # features reading each table (named f{table}_{k})
    dim: int
    pooling: int  # mean ids per bag (EBC); ids per sequence (EC)
    batch: int


TABLE_SETS = [
    TableSet("small", [1000] * 4, 1, 16, 4, 512),
    TableSet("few_large", [200_000] * 4, 1, 128, 20, 2048),
    TableSet("criteo_like", CRITEO_ROWS, 1, 64, 3, 2048),
    TableSet("many_small", [500] * 128, 1, 16, 2, 512),
    TableSet("shared_tables", [20_000] * 4, 8, 32, 4, 1024),
]


@dataclass
class Record:
    bench: str
    api: str
    module: str
    tables: str
    batch: int
    steps: int
    optimizer: str
    median_step_ms: float


def _feature_names(tables: TableSet) -> List[List[str]]:
    return [
        [f"f{t}_{k}" for k in range(tables.features_per_table)] for t in range(len(tables.rows))
    ]


def _batch(api: ModuleType, tables: TableSet, batch: int, seed: int) -> object:
    g = torch.Generator().manual_seed(seed)
    rows = [r for r in tables.rows for _ in range(tables.features_per_table)]
    lengths = torch.randint(0, 2 * tables.pooling + 1, (len(rows), batch), generator=g)
    values = torch.cat(
        [torch.randint(0, r, (int(n),), generator=g) for r, n in zip(rows, lengths.sum(1))]
    )
    keys = [f for names in _feature_names(tables) for f in names]
    return api.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths.flatten().int())


def _module(api: ModuleType, kind: str, tables: TableSet) -> torch.nn.Module:
    torch.manual_seed(0)
    config = api.EmbeddingBagConfig if kind == "ebc" else api.EmbeddingConfig
    configs = [
        config(num_embeddings=rows, embedding_dim=tables.dim, name=f"t{i}", feature_names=names)
        for i, (rows, names) in enumerate(zip(tables.rows, _feature_names(tables)))
    ]
    if kind == "ebc":
        return api.EmbeddingBagCollection(tables=configs)
    return api.EmbeddingCollection(tables=configs)


def _loss(kind: str) -> Callable[[object], torch.Tensor]:
    if kind == "ebc":
        return lambda out: out.values().sum()
    return lambda out: sum(jt.values().sum() for jt in out.values())


def bench(api_name: str, kind: str, tables: TableSet, batch: int, steps: int, optim: str) -> Record:
    api = importlib.import_module(api_name)
    module = _module(api, kind, tables)
    # "none": forward + backward only (Adam's dense pass over every row, the same code in
    # any library, dominates the larger steps and hides the module's own cost)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01) if optim == "adam" else None
    batches = [_batch(api, tables, batch, seed) for seed in range(4)]
    loss_of = _loss(kind)
    times: List[float] = []
    for step in range(steps + 3):  # 3 warm-up steps
        features = batches[step % len(batches)]
        start = time.perf_counter()
        module.zero_grad()
        loss_of(module(features)).backward()
        if optimizer is not None:
            optimizer.step()
        if step >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return Record(
        "module_step",
        api_name,
        kind,
        tables.name,
        batch,
        steps,
        optim,
        round(statistics.median(times), 3),
    )


@dataclass(frozen=True)
class Side:
    """One contender of `--compare`: `[LABEL=]PYTHON:API[@DIR]` (DIR: the working directory
    its runs import from, e.g. a checkout of another recshard commit)."""

    label: str
    python: str
    api: str
    cwd: str | None

    @staticmethod
    def parse(spec: str) -> Side:
        label, _, rest = spec.rpartition("=")
        rest, _, cwd = rest.partition("@")
        python, _, api = rest.rpartition(":")
        if not python or not api:
            raise ValueError(f"--compare {spec!r}: expected [LABEL=]PYTHON:API[@DIR]")
        return Side(label or api, os.path.abspath(python), api, cwd or None)


def compare(args: argparse.Namespace, own: List[str]) -> None:
    """Alternate fresh runs of recshard (this interpreter and directory) and every `--compare`
    side, one process per table set (what one table set leaves in the allocator changes the
    next one's page faults by up to 30%); print every record (with the side's label as `side`), then
    one `module_compare` line per (module, table set) with each side's median and its ratio to
    recshard's."""
    sides = [Side("recshard", sys.executable, "recshard", None)] + [
        Side.parse(s) for s in args.compare
    ]
    runs: Dict[Tuple[str, str, str], List[float]] = {}
    for _ in range(args.repeats):
        for tables in args.tables.split(","):
            for side in sides:
                proc = subprocess.run(
                    [
                        side.python,
                        "-m",
                        "benchmarks.modules",
                        "--api",
                        side.api,
                        "--tables",
                        tables,
                        *own,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=side.cwd,
                )
                for line in proc.stdout.splitlines():
                    record = {**json.loads(line), "side": side.label}
                    print(json.dumps(record), flush=True)
                    runs.setdefault((record["module"], record["tables"], side.label), []).append(
                        record["median_step_ms"]
                    )
    for module, tables, label in list(runs):
        if label != "recshard":
            continue
        ours = statistics.median(runs[(module, tables, "recshard")])
        line = {
            "bench": "module_compare",
            "module": module,
            "tables": tables,
            "optimizer": args.optimizer,
            "repeats": args.repeats,
            "recshard_ms": ours,
        }
        for side in sides[1:]:
            theirs = statistics.median(runs[(module, tables, side.label)])
            line.update(
                {f"{side.label}_ms": theirs, f"ratio_to_{side.label}": round(ours / theirs, 3)}
            )
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", default="recshard")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None, help="default: each table set's")
    parser.add_argument(
        "--tables", default=None, help="comma-separated; default: all (--quick: small,criteo_like)"
    )
    parser.add_argument("--modules", default="ebc,ec")
    parser.add_argument("--optimizer", choices=["adam", "none"], default="none")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compare", nargs="+", default=None, metavar="[LABEL=]PYTHON:API[@DIR]")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.tables is None:
        args.tables = "small,criteo_like" if args.quick else ",".join(t.name for t in TABLE_SETS)
    own = [
        "--steps",
        str(args.steps),
        "--modules",
        args.modules,
        "--optimizer",
        args.optimizer,
        "--threads",
        str(args.threads),
    ]
    own += ["--quick"] if args.quick else []
    own += ["--batch", str(args.batch)] if args.batch else []
    if args.compare:
        compare(args, own)
        return
    torch.set_num_threads(args.threads)
    by_name = {t.name: t for t in TABLE_SETS}
    for name in args.tables.split(","):
        tables = by_name[name]
        steps, batch = (3, 64) if args.quick else (args.steps, args.batch or tables.batch)
        for kind in args.modules.split(","):
            record = bench(args.api, kind, tables, batch, steps, args.optimizer)
            print(json.dumps(asdict(record)), flush=True)


if __name__ == "__main__":
    main()
