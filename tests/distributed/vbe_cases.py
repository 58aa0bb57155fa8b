"""Variable-batch (VBE) batches for sharded-vs-unsharded tests: each rank's features have
their own batch sizes, brought to one batch of `B_out` rows by `inverse_indices`."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from recshard import KeyedJaggedTensor
from recshard.modules.embedding_configs import EmbeddingBagConfig

KEYS = [f"f{i}" for i in [5, 3, 0, 2, 4, 1]]  # input key order differs from the module's


def feature_batches(rank: int, step: int, shape: str, batch_out: int) -> Dict[str, int]:
    """Batch size of each feature on `rank` at `step`. "user_item": f0, f2 one row (a user),
    the rest `batch_out` (items); "per_rank": sizes that differ per feature and per rank;
    "empty": as per_rank, with f3's bags all empty; "rank0_fixed": rank 0 sends an ordinary
    batch (no variable batch, no inverse indices), the others as per_rank."""
    if shape == "user_item":
        return {k: 1 if k in ("f0", "f2") else batch_out for k in KEYS}
    if shape == "rank0_fixed" and rank == 0:
        return {k: batch_out for k in KEYS}
    return {k: 1 + (rank + step + i) % 3 for i, k in enumerate(KEYS)}


# drawn sizes of one rank's batch: (rows out, the batch size of each feature in KEYS order)
Drawn = Tuple[int, Tuple[int, ...]]


def vbe_batch(
    rank: int,
    step: int,
    shape: str,
    weighted: bool,
    tables: List[EmbeddingBagConfig],
    drawn: Drawn | None = None,
) -> KeyedJaggedTensor:
    """Rank `rank`'s variable-batch KJT at `step` (any rank can rebuild any other's); `drawn`
    gives its sizes instead of `shape`."""
    g = torch.Generator().manual_seed(10_000 + 1000 * step + rank)
    rows: Dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    batch_out = 2 + (rank + step) % 3
    batches = feature_batches(rank, step, shape, batch_out)
    if drawn is not None:
        batch_out, batches = drawn[0], dict(zip(KEYS, drawn[1]))
    lengths = [torch.randint(0, 4, (batches[k],), generator=g) for k in KEYS]
    if shape == "empty":
        lengths[KEYS.index("f3")].zero_()
    values = torch.cat(
        [torch.randint(0, rows[k], (int(n.sum()),), generator=g) for k, n in zip(KEYS, lengths)]
    )
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    inverse = torch.stack([torch.randint(0, batches[k], (batch_out,), generator=g) for k in KEYS])
    if shape == "rank0_fixed" and rank == 0:
        return KeyedJaggedTensor(KEYS, values, weights, lengths=torch.cat(lengths))
    return KeyedJaggedTensor(
        KEYS,
        values,
        weights,
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[batches[k]] for k in KEYS],
        inverse_indices=(list(reversed(KEYS)), inverse.flip(0)),  # any key order
    )
