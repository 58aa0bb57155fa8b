"""`Batch`: dense features, sparse ids (a KJT) and labels, moved and pinned as a unit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recshard.sparse import KeyedJaggedTensor
from recshard.types import Pipelineable


@dataclass
class Batch(Pipelineable):
    """`dense_features [B, num_dense]` float, `sparse_features` a KJT of stride B, `labels [B]`.

    A `Pipelineable`, so `TrainPipelineSparseDist` can copy it to the device ahead of time.
    """

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(
                torch.device(device), non_blocking=non_blocking
            ),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark the device tensors as used on `stream` (CPU tensors need nothing)."""
        for tensor in (self.dense_features, self.labels):
            if tensor.is_cuda:
                tensor.record_stream(stream)
        self.sparse_features.record_stream(stream)

    @property
    def batch_size(self) -> int:
        return int(self.labels.numel())
