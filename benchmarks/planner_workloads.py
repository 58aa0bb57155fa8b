"""The workloads of `benchmarks.planner_accuracy`: the 26 Criteo-like tables at a dim, uniform
or Zipf ids, a per-rank batch; their batches, and the cache statistics the planner is given
(`SampledCacheStatistics`: distinct rows per global batch, sampled from the same generator)."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

from benchmarks.ebc_workload import CRITEO_KAGGLE_ROWS, pooling_factors
from recshard import EmbeddingBagConfig, KeyedJaggedTensor
from recshard.planner import TableMeta
from recshard.types import CacheParams, CacheStatistics

ZIPF_S = 1.05
STATS_SEED = 1000  # sampled cache statistics: seeds apart from the ranks' (1 + rank)


@dataclass(frozen=True)
class Workload:
    dim: int
    ids: str  # "uniform" | "zipf"
    batch: int  # per rank

    @property
    def name(self) -> str:
        return f"d{self.dim}_{self.ids}_b{self.batch}"


def configs(w: Workload, row_cap: int) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            num_embeddings=min(rows, row_cap),
            embedding_dim=w.dim,
            name=f"t{i}",
            feature_names=[f"cat_{i}"],
        )
        for i, rows in enumerate(CRITEO_KAGGLE_ROWS)
    ]


def metas(w: Workload, row_cap: int, max_pooling: int) -> List[TableMeta]:
    pooling = pooling_factors(len(CRITEO_KAGGLE_ROWS), max_pooling)
    return [
        TableMeta(
            c.name,
            c.num_embeddings,
            c.embedding_dim,
            list(c.feature_names),
            pooling_factors=[float(p)],
            optimizer="exact_sgd",
        )
        for c, p in zip(configs(w, row_cap), pooling)
    ]


def _ids(rows: int, count: int, kind: str, g: torch.Generator, table: int) -> torch.Tensor:
    if kind == "uniform":
        return torch.randint(0, rows, (count,), generator=g)
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-ZIPF_S)
    ranks = torch.multinomial(weights, count, replacement=True, generator=g)
    hot = torch.randperm(rows, generator=torch.Generator().manual_seed(table))
    return hot[ranks]  # the hot rows scattered over the table


def make_batches(
    w: Workload, row_cap: int, max_pooling: int, seed: int, count: int
) -> List[KeyedJaggedTensor]:
    tables = configs(w, row_cap)
    pooling = pooling_factors(len(tables), max_pooling)
    g = torch.Generator().manual_seed(seed)
    keys = [t.feature_names[0] for t in tables]
    lengths = torch.tensor(pooling, dtype=torch.int32).repeat_interleave(w.batch)
    return [
        KeyedJaggedTensor.from_lengths_sync(
            keys,
            torch.cat(
                [
                    _ids(t.num_embeddings, p * w.batch, w.ids, g, i)
                    for i, (t, p) in enumerate(zip(tables, pooling))
                ]
            ),
            lengths,
            stride=w.batch,
        )
        for _ in range(count)
    ]


class SampledCacheStatistics(CacheStatistics):
    """One table's statistics measured on sample global batches of its ids, as a user would
    measure them on their data: distinct rows per batch (averaged), and the miss rate of a
    cache holding the sample's hottest rows."""

    def __init__(self, batches: Sequence[torch.Tensor], rows: int) -> None:
        self._lookups = statistics.mean(float(b.unique().numel()) for b in batches)
        counts = torch.bincount(torch.cat(batches), minlength=rows).sort(descending=True).values
        self._hit = counts.cumsum(0).double() / counts.sum()  # hottest k + 1 rows' share
        self._rows = rows

    @property
    def expected_lookups(self) -> float:
        return self._lookups

    def expected_miss_rate(self, clf: float) -> float:
        cached = min(int(clf * self._rows), self._rows)
        return 1.0 if cached <= 0 else 1.0 - float(self._hit[cached - 1])

    @property
    def cacheability(self) -> float:
        return statistics.mean(self.expected_miss_rate(i / 20) for i in range(21))


def sampled_cache_params(w: Workload, args: argparse.Namespace) -> Dict[str, CacheParams]:
    """Per table, a `CacheParams` whose stats come from `args.stats_samples` global batches
    (every rank's batch) drawn by the workload's id generator with seeds the timed runs do
    not use."""
    per_table: Dict[str, List[torch.Tensor]] = {}
    for sample in range(args.stats_samples):
        ranks = [
            make_batches(
                w, args.row_cap, args.max_pooling, STATS_SEED + sample * args.world_size + r, 1
            )[0]
            for r in range(args.world_size)
        ]
        for c in configs(w, args.row_cap):
            key = c.feature_names[0]
            per_table.setdefault(c.name, []).append(torch.cat([b[key].values() for b in ranks]))
    return {
        c.name: CacheParams(stats=SampledCacheStatistics(per_table[c.name], c.num_embeddings))
        for c in configs(w, args.row_cap)
    }
