"""Building a batch's KJT; the batch type itself is `recshard.datasets.utils.Batch`."""

from __future__ import annotations

from typing import List

import torch

from recshard import KeyedJaggedTensor


def make_kjt(
    keys: List[str], ids_per_feature: List[torch.Tensor], lengths_per_feature: List[torch.Tensor]
) -> KeyedJaggedTensor:
    """KJT from per-feature ids (`[N_f]` int64) and lengths (`[B]` int32), keys in order."""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat(ids_per_feature),
        lengths=torch.cat(lengths_per_feature).to(torch.int32),
    )
