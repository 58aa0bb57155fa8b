"""Deduplicated input for the sharded EmbeddingCollection (TorchRec's `use_index_dedup`).

Before its input dist, each feature's ids are reduced to the distinct ones of this rank's
batch (all of a feature's distinct ids ride in its first sample's slot), so every distinct id
crosses the all-to-alls and is looked up once. After the output dist each feature's rows are
spread back to every id by the inverse indices (`index_select`, whose backward sums the
gradients of an id's copies, as the lookup would have): the same outputs and gradients as
without deduplication, for less traffic when ids repeat within a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from recshard.sparse import JaggedTensor, KeyedJaggedTensor


@dataclass
class Deduplicated:
    """The caller's batch, and per feature the position of each of its ids among that
    feature's distinct ids."""

    features: KeyedJaggedTensor
    inverse: Dict[str, torch.Tensor]


def deduplicate(features: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, Deduplicated] | None:
    """This rank's batch with each feature's distinct ids only; None when it carries weights
    or cannot be read (the collection's own checks then judge it as it is)."""
    if features.weights_or_none() is not None or features.variable_stride_per_key():
        return None
    try:
        keys, values = features.keys(), features.values()
        counts = torch.tensor(features.length_per_key(), device=values.device)
        key_of = torch.repeat_interleave(torch.arange(len(keys), device=values.device), counts)
        pairs = torch.stack([key_of, values.to(torch.int64)], dim=1)
        distinct, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    except (RuntimeError, ValueError, IndexError):
        return None
    per_key = torch.bincount(distinct[:, 0], minlength=len(keys))
    first = torch.cumsum(per_key, 0) - per_key  # each key's first distinct id
    local = inverse - first[key_of]
    stride = features.stride()
    lengths = torch.zeros(len(keys) * stride, dtype=features.lengths().dtype, device=values.device)
    if stride:
        lengths[::stride] = per_key.to(lengths.dtype)
    reduced = KeyedJaggedTensor(
        keys, distinct[:, 1].to(values.dtype), lengths=lengths, stride=stride
    )
    by_key = dict(zip(keys, local.split(features.length_per_key())))
    return reduced, Deduplicated(features, by_key)


def restore(
    looked_up: Dict[str, JaggedTensor],
    dedup: Deduplicated,
    feature_of: Dict[str, str],
    need_indices: bool,
) -> Dict[str, JaggedTensor]:
    """Each output's rows for its feature's distinct ids, spread back over the caller's ids
    (`feature_of`: the input feature of each output key, `f` of `f@table`)."""
    original = dedup.features.to_dict()
    out: Dict[str, JaggedTensor] = {}
    for name, jt in looked_up.items():
        feature = feature_of[name]
        source = original[feature]
        out[name] = JaggedTensor(
            jt.values().index_select(0, dedup.inverse[feature]),
            weights=source.values() if need_indices else None,
            lengths=source.lengths(),
            offsets=source.offsets(),
        )
    return out
