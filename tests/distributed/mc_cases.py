"""Models and batches for the sharded managed collision tests (run inside rank processes)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from recshard.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
)
from recshard.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from recshard.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recshard.sparse import KeyedJaggedTensor

KEYS = ["a", "b", "c"]
HASH_SIZE = 2**40
LR = 0.1


def _reset_init(w: torch.Tensor) -> None:
    """The same values for every row (sharded and unsharded reset different row sets)."""
    w.copy_(torch.linspace(-0.2, 0.2, w.size(1)).expand_as(w))


class SparseModel(nn.Module):
    """An MC-EBC and a loss that weights every output column differently."""

    def __init__(
        self,
        buckets: int,
        lru: bool = False,
        zch: Tuple[int, int] = (23, 17),
        return_remapped: bool = False,
    ) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(zch[0], 4, name="t0", feature_names=["a", "b"], init_fn=_reset_init),
            EmbeddingBagConfig(
                zch[1],
                3,
                name="t1",
                feature_names=["c"],
                init_fn=_reset_init,
                pooling=PoolingType.MEAN,
            ),
        ]
        ebc = EmbeddingBagCollection(tables)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for bag in ebc.embedding_bags.values():
                bag.weight.copy_(torch.rand(bag.weight.shape, generator=gen) - 0.5)
        policies = {"t0": LFU_EvictionPolicy(), "t1": DistanceLFU_EvictionPolicy(1.5)}
        if lru:
            policies = {"t0": LRU_EvictionPolicy(), "t1": LRU_EvictionPolicy(2.0)}
        intervals = {"t0": 2, "t1": 1}
        mcc = ManagedCollisionCollection(
            {
                t.name: MCHManagedCollisionModule(
                    t.num_embeddings,
                    "cpu",
                    policies[t.name],
                    intervals[t.name],
                    input_hash_size=HASH_SIZE,
                    buckets=buckets,
                    name=t.name,
                )
                for t in tables
            },
            tables,
        )
        self.sparse = ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped)
        self.register_buffer("mix", torch.linspace(-1.0, 1.0, 11))
        self.remapped: KeyedJaggedTensor | None = None  # the last forward's, if returned

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled, self.remapped = self.sparse(kjt)
        return pooled.values() * self.mix


def local_ids(step: int, rank: int, batch: int = 4) -> Dict[str, List[List[int]]]:
    """Each feature's bags for one rank and step: a hot head and a long tail of 64-bit ids."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out: Dict[str, List[List[int]]] = {}
    for k, key in enumerate(KEYS):
        bags = []
        for _ in range(batch):
            n = int(torch.randint(0, 5, (1,), generator=gen))
            u = torch.randint(1, 200, (n,), generator=gen).double()
            ids = ((200 / u).floor().long() * 1_000_003_111 + k) % HASH_SIZE
            bags.append(ids.tolist())
        out[key] = bags
    return out


def kjt_of(parts: List[Dict[str, List[List[int]]]]) -> KeyedJaggedTensor:
    """One KJT from several ranks' bags (their batches concatenated in rank order)."""
    values, lengths = [], []
    for key in KEYS:
        for part in parts:
            for bag in part[key]:
                values += bag
                lengths.append(len(bag))
    return KeyedJaggedTensor.from_lengths_sync(
        KEYS, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths)
    )


class SequenceModel(nn.Module):
    """An MC-EC (one row per id) over the same ids; LRU and LFU tables."""

    def __init__(self, buckets: int, return_remapped: bool = False) -> None:
        super().__init__()
        tables = [
            EmbeddingConfig(19, 4, name="t0", feature_names=["a", "b"], init_fn=_reset_init),
            EmbeddingConfig(13, 4, name="t1", feature_names=["c"], init_fn=_reset_init),
        ]
        ec = EmbeddingCollection(tables)
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for emb in ec.embeddings.values():
                emb.weight.copy_(torch.rand(emb.weight.shape, generator=gen) - 0.5)
        policies = {"t0": LRU_EvictionPolicy(), "t1": LFU_EvictionPolicy()}
        mcc = ManagedCollisionCollection(
            {
                t.name: MCHManagedCollisionModule(
                    t.num_embeddings, "cpu", policies[t.name], 1, HASH_SIZE, buckets=buckets
                )
                for t in tables
            },
            tables,
        )
        self.sparse = ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped)
        self.register_buffer("mix", torch.linspace(-1.0, 1.0, 4))
        self.remapped: KeyedJaggedTensor | None = None  # the last forward's, if returned

    def forward(self, kjt: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        rows, self.remapped = self.sparse(kjt)
        return {f: rows[f].values() * self.mix * (k + 1) for k, f in enumerate(KEYS)}


def bucket_universe(module: MCHManagedCollisionModule, spread: bool = True) -> torch.Tensor:
    """Candidate ids of the module's buckets, from `4 * zch + 50` numbers: scattered over
    `[0, 2**40)` when `spread` (each of their low five bytes differs), else small and
    consecutive."""
    first, last = module.bucket_range()
    buckets = module.buckets()
    universe = torch.arange(4 * module.output_size() + 50)
    if spread:
        universe = universe * 2_654_435_761_987 % HASH_SIZE
    return universe[(universe % buckets >= first) & (universe % buckets < last)]


def skewed_ids(
    gen: torch.Generator, universe: torch.Tensor, n: int, exponent: float = 0.7
) -> torch.Tensor:
    """`n` draws from `universe`, its k-th id with weight `1 / (k + 1) ** exponent`: repeats,
    hits and ties among counts."""
    if n == 0:
        return universe[:0]
    weights = 1.0 / (torch.arange(universe.numel()) + 1.0) ** exponent
    return universe[torch.multinomial(weights, n, replacement=True, generator=gen)]
