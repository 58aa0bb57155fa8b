"""Single-process, several-device data movement for inference (TorchRec's `KJTOneToAll`,
`SeqEmbeddingsAllToOne`, `EmbeddingsAllToOne`, `EmbeddingsAllToOneReduce`): split one batch of
features across devices, and bring each device's embeddings back to one device (joined or
summed). No collective: one process drives every device (on CPU every "device" is the CPU)."""

from __future__ import annotations

from typing import Any, Iterator, List

import torch
from torch import nn

from recshard.sparse import KeyedJaggedTensor


class KJTList:
    """A list of KeyedJaggedTensors (one per device or sharding) that moves across streams
    together."""

    def __init__(self, features: List[KeyedJaggedTensor]) -> None:
        self.features = features

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> KeyedJaggedTensor:
        return self.features[index]

    def __setitem__(self, index: int, item: KeyedJaggedTensor) -> None:
        self.features[index] = item

    def __iter__(self) -> Iterator[KeyedJaggedTensor]:
        return iter(self.features)

    def record_stream(self, stream: Any) -> None:  # noqa: ANN401 - a torch stream
        for feature in self.features:
            feature.record_stream(stream)


def _rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device(device_type, rank) if device_type == "cuda" else torch.device(device_type)


class KJTOneToAll(nn.Module):
    """Split a KJT's keys into `splits` consecutive groups (one per device) and move group `i`
    to device `i` of `device`'s type (`cuda:i`; CPU and meta stay where they are).

    TorchRec sends to CUDA even when told "cpu"; recshard follows `device` (default CPU)."""

    def __init__(self, splits: List[int], world_size: int, device: torch.device | None = None):
        super().__init__()
        if len(splits) != world_size:
            raise ValueError(
                f"KJTOneToAll: {len(splits)} splits {splits} for world_size {world_size}"
            )
        self._splits, self._world_size = list(splits), world_size
        self._device_type = "cpu" if device is None else torch.device(device).type

    def forward(self, kjt: KeyedJaggedTensor) -> KJTList:
        if sum(self._splits) != len(kjt.keys()):
            raise ValueError(
                f"KJTOneToAll: splits {self._splits} cover {sum(self._splits)} keys, the batch "
                f"has {len(kjt.keys())}: {kjt.keys()}"
            )
        pieces = kjt.split(self._splits)
        if self._device_type == "meta":
            return KJTList(pieces)
        return KJTList(
            [
                piece.to(_rank_device(self._device_type, rank), non_blocking=True)
                for rank, piece in enumerate(pieces)
            ]
        )


class SeqEmbeddingsAllToOne(nn.Module):
    """Every device's sequence embeddings moved to `device` (a list, one tensor per device;
    TorchRec's `all_to_one_device`)."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        super().__init__()
        self._device, self._world_size = torch.device(device), world_size

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        if len(tensors) != self._world_size:
            raise ValueError(
                f"SeqEmbeddingsAllToOne: expected {self._world_size} tensors, got {len(tensors)}"
            )
        return [t.to(self._device) for t in tensors]


class EmbeddingsAllToOne(nn.Module):
    """Single process, several devices: every device's `[B, D_i]` joined on `device`
    (concatenated along `cat_dim`). On CPU it is a concatenation."""

    def __init__(self, device: torch.device, world_size: int, cat_dim: int) -> None:
        super().__init__()
        self._device, self._world_size, self._cat_dim = torch.device(device), world_size, cat_dim

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != self._world_size:
            raise ValueError(
                f"EmbeddingsAllToOne: expected {self._world_size} tensors, got {len(tensors)}"
            )
        return torch.cat([t.to(self._device) for t in tensors], dim=self._cat_dim)


class EmbeddingsAllToOneReduce(nn.Module):
    """Single process, several devices: every device's `[B, D]` summed on `device`."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        super().__init__()
        self._device, self._world_size = torch.device(device), world_size

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != self._world_size:
            raise ValueError(
                f"EmbeddingsAllToOneReduce: expected {self._world_size} tensors, got {len(tensors)}"
            )
        return torch.stack([t.to(self._device) for t in tensors]).sum(0)
