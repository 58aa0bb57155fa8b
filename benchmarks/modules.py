"""Unsharded EBC / EC step (forward + backward + Adam) in one process, on a small and a
Criteo-like table set. Prints one JSON line per (module, table set).

    python -m benchmarks.modules                 # recshard
    python -m benchmarks.modules --quick         # smaller batches, fewer steps
    python -m benchmarks.modules --api torchrec  # the same work through another library
                                                 # with TorchRec's names (run it from that
                                                 # library's venv, e.g. /tmp/torchrec-venv)

`--api` names a module exposing EmbeddingBagCollection, EmbeddingBagConfig,
EmbeddingCollection, EmbeddingConfig and KeyedJaggedTensor (recshard's top level does);
nothing here depends on any other library. For a comparison, alternate runs of both (A B A
B ...) and compare medians: absolute times on a shared machine drift between runs.
Seeds are fixed; `median_step_ms` is the median over `--steps` timed steps after a warm-up.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Callable, List

import torch

# Criteo-like: 26 one-feature tables, the rows of its 26 categorical features capped at 10 k
# (the dense optimizer's pass over every row, the same in any library, would hide the rest)
CRITEO_ROWS = [1460, 583, 10000, 10000, 305, 24, 10000, 633, 3, 10000, 5683, 10000, 3194,
               27, 10000, 10000, 10, 5652, 2173, 4, 10000, 18, 15, 10000, 105, 10000]


@dataclass(frozen=True)
class TableSet:
    name: str
    rows: List[int]
    dim: int
    pooling: int  # mean ids per bag (EBC); ids per sequence (EC)


TABLE_SETS = [TableSet("small", [1000] * 4, 16, 4), TableSet("criteo_like", CRITEO_ROWS, 64, 3)]


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


def _batch(api: ModuleType, tables: TableSet, batch: int, seed: int) -> object:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * tables.pooling + 1, (len(tables.rows), batch), generator=g)
    values = torch.cat([
        torch.randint(0, rows, (int(n),), generator=g) for rows, n in zip(tables.rows, lengths.sum(1))
    ])
    keys = [f"f{i}" for i in range(len(tables.rows))]
    return api.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths.flatten().int())


def _module(api: ModuleType, kind: str, tables: TableSet) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "ebc":
        return api.EmbeddingBagCollection(tables=[
            api.EmbeddingBagConfig(num_embeddings=rows, embedding_dim=tables.dim, name=f"t{i}",
                                   feature_names=[f"f{i}"])
            for i, rows in enumerate(tables.rows)])
    return api.EmbeddingCollection(tables=[
        api.EmbeddingConfig(num_embeddings=rows, embedding_dim=tables.dim, name=f"t{i}",
                            feature_names=[f"f{i}"])
        for i, rows in enumerate(tables.rows)])


def _loss(kind: str) -> Callable[[object], torch.Tensor]:
    if kind == "ebc":
        return lambda out: out.values().sum()
    return lambda out: sum(jt.values().sum() for jt in out.values())


def bench(api_name: str, kind: str, tables: TableSet, batch: int, steps: int, optim: str) -> Record:
    api = importlib.import_module(api_name)
    module = _module(api, kind, tables)
    # "none": forward + backward only (Adam's dense pass over every row, the same code in
    # any library, dominates the Criteo-like step and hides the module's own cost)
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
    return Record("module_step", api_name, kind, tables.name, batch, steps, optim,
                  round(statistics.median(times), 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", default="recshard")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--optimizer", choices=["adam", "none"], default="adam")
    args = parser.parse_args()
    steps, batch = (3, 64) if args.quick else (args.steps, args.batch)
    torch.set_num_threads(1)
    for tables in TABLE_SETS:
        for kind in ("ebc", "ec"):
            print(json.dumps(asdict(bench(args.api, kind, tables, batch, steps, args.optimizer))), flush=True)


if __name__ == "__main__":
    main()
