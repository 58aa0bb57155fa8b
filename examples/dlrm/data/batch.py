"""One training batch: dense features, sparse ids (a KJT) and labels, movable as a unit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from recshard import KeyedJaggedTensor


@dataclass
class Batch:
    """`dense_features [B, 13]` float, `sparse_features` a KJT of stride B, `labels [B]`.

    Implements `recshard.types.Pipelineable` (`to`, `pin_memory`, `record_stream`), so
    `TrainPipelineSparseDist` can copy it to the device ahead of time.
    """

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(torch.device(device), non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(
            self.dense_features.pin_memory(),
            self.sparse_features.pin_memory(),
            self.labels.pin_memory(),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for tensor in (self.dense_features, self.labels):
            if tensor.is_cuda:
                tensor.record_stream(stream)
        self.sparse_features.record_stream(stream)

    @property
    def batch_size(self) -> int:
        return int(self.labels.numel())


def make_kjt(keys: List[str], ids_per_feature: List[torch.Tensor],
             lengths_per_feature: List[torch.Tensor]) -> KeyedJaggedTensor:
    """KJT from per-feature ids (`[N_f]` int64) and lengths (`[B]` int32), keys in order."""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat(ids_per_feature),
        lengths=torch.cat(lengths_per_feature).to(torch.int32),
    )
