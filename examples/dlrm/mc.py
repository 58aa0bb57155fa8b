"""Raw ids through managed collision (`--managed-collision ZCH_SIZE`): the DLRM's tables sit
behind a `ManagedCollisionEmbeddingBagCollection` whose MCH modules give frequent raw ids rows
of their own, and the per-table metrics (ids evicted, rows in use, hit rate) the CLI logs.

Criteo values are 32-bit hex codes; hashing them into a table of `RAW_ID_SPACE` rows (the
reader's and the preprocessor's `1 + code % (rows - 1)`) leaves `code + 1`, with 0 for a
missing value, so the MC modules see every raw code as its own id.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.modules.embedding_modules import DeviceLike
from recshard.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recshard.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recshard.sparse import KeyedJaggedTensor, KeyedTensor

RAW_ID_SPACE = 2**32 + 2  # "table size" whose hashing keeps a 32-bit code: code + 1, 0 missing
MC_NAME = "managed_collision"  # the MC-EBC's attribute in its wrapper (part of its plan path)
_COUNTED = ("lookups", "hits", "admitted", "evicted", "rows_in_use")


class ManagedCollisionSparse(nn.Module):
    """A `ManagedCollisionEmbeddingBagCollection` that returns only the pooled KeyedTensor, so
    DLRM's SparseArch takes it where it takes an EBC (the MC-EBC returns a tuple)."""

    def __init__(self, mc_ebc: ManagedCollisionEmbeddingBagCollection) -> None:
        super().__init__()
        self.managed_collision = mc_ebc  # attribute named MC_NAME

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self.managed_collision.embedding_bag_configs()

    def is_weighted(self) -> bool:
        return False

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pooled, _ = self.managed_collision(features)
        return pooled


def build_managed_collision(
    tables: List[EmbeddingBagConfig],
    eviction_interval: int,
    buckets: int,
    device: DeviceLike = None,
) -> ManagedCollisionSparse:
    """The tables behind one MCH module each (zch size = the table's rows, raw ids in
    `[0, RAW_ID_SPACE)`, DistanceLFU eviction every `eviction_interval` steps, `buckets`
    buckets so row-wise shards cut at bucket edges). The EBC goes on `device` (meta: DMP
    materializes it); the MC modules are built on CPU, the sharder moves them."""
    modules = {
        t.name: MCHManagedCollisionModule(
            zch_size=t.num_embeddings,
            device="cpu",
            eviction_policy=DistanceLFU_EvictionPolicy(),
            eviction_interval=eviction_interval,
            input_hash_size=RAW_ID_SPACE,
            name=t.name,
            buckets=min(buckets, t.num_embeddings),
        )
        for t in tables
    }
    mcc = ManagedCollisionCollection(modules, tables)
    ebc = EmbeddingBagCollection(tables=tables, device=device)
    return ManagedCollisionSparse(ManagedCollisionEmbeddingBagCollection(ebc, mcc))


def _local_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """Every table's MC module this rank holds (its buckets when sharded)."""
    for module in model.modules():
        if hasattr(module, "local_modules"):
            return module.local_modules()  # ShardedManagedCollisionCollection
        if isinstance(module, ManagedCollisionCollection):
            return module.modules_by_table()
    return {}


def collect_metrics(model: nn.Module) -> Dict[str, Dict[str, float]]:
    """Per table, over every rank since the last call: ids looked up, hits, ids admitted and
    evicted, hit rate, and rows now in use (collective: every rank calls it at the same step)."""
    modules = _local_modules(model)
    names = list(modules)  # table order, the same on every rank
    per_table = [modules[t].metrics() for t in names]  # each call resets its counters
    # on the modules' device: NCCL reduces device tensors only
    device = modules[names[0]].device if names else torch.device("cpu")
    rows = [[m[k] for k in _COUNTED] for m in per_table]
    counts = torch.tensor(rows, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    out = {}
    for table, row in zip(names, counts.tolist()):
        metrics = dict(zip(_COUNTED, row))
        metrics["hit_rate"] = metrics["hits"] / metrics["lookups"] if metrics["lookups"] else 0.0
        out[table] = metrics
    return out


class ManagedCollisionLog:
    """Metrics since the previous report, and totals since the start of this run."""

    def __init__(self) -> None:
        self.totals: Dict[str, Dict[str, float]] = {}

    def report(self, model: nn.Module, step: int) -> str:
        """Collect (collective) and describe: one line for all tables, one per table."""
        metrics = collect_metrics(model)
        for table, m in metrics.items():
            total = self.totals.setdefault(table, dict.fromkeys(("lookups", "hits", "evicted"), 0))
            for key in total:
                total[key] += m[key]
        lookups = sum(m["lookups"] for m in metrics.values())
        hits = sum(m["hits"] for m in metrics.values())
        lines = [
            f"managed collision @ step {step}: {int(sum(m['evicted'] for m in metrics.values()))} "
            f"ids evicted, {int(sum(m['rows_in_use'] for m in metrics.values())):,} rows in use, "
            f"hit rate {hits / lookups if lookups else 0.0:.4f} since the last report"
        ]
        lines += [
            f"  {table:<9} evicted {int(m['evicted']):>7}  rows in use "
            f"{int(m['rows_in_use']):>9}  hit rate {m['hit_rate']:.4f}"
            for table, m in metrics.items()
        ]
        return "\n".join(lines)

    def summary(self) -> Dict[str, Dict[str, float]]:
        """Per table: ids evicted, lookups and hit rate over the whole run."""
        return {
            t: {**m, "hit_rate": m["hits"] / m["lookups"] if m["lookups"] else 0.0}
            for t, m in self.totals.items()
        }
