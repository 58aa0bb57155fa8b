"""`LowRankCrossNet`: DCN-v2's cross network with low-rank weights, TorchRec's name and layout.

    x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l        x: [B, in_features]

Parameters are TorchRec's `W_kernels [in, r]`, `V_kernels [r, in]`, `bias [in]` (one per
layer), so state_dicts carry over. Built on `meta`, it is materialized by
`reset_parameters()` (xavier-normal kernels, zero bias), as `DistributedModelParallel` does.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import nn

from recshard.modules.embedding_configs import DeviceLike


class _InitializedList(nn.ParameterList):
    """Parameters of one shape and one initializer; `reset_parameters` lets
    `DistributedModelParallel` initialize them when it materializes the list off `meta`."""

    def __init__(
        self,
        count: int,
        shape: Tuple[int, ...],
        init: Callable[[torch.Tensor], object],
        device: DeviceLike,
    ) -> None:
        super().__init__(nn.Parameter(torch.empty(shape, device=device)) for _ in range(count))
        self._init = init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Apply the initializer to every parameter; a no-op on `meta`."""
        with torch.no_grad():
            for param in self:
                if not param.is_meta:
                    self._init(param)


class LowRankCrossNet(nn.Module):
    """`num_layers` cross layers of rank `low_rank`: `[B, N]` -> `[B, N]`."""

    def __init__(
        self, in_features: int, num_layers: int, low_rank: int = 1, device: DeviceLike = None
    ) -> None:
        super().__init__()
        if low_rank < 1:
            raise ValueError(f"LowRankCrossNet: low_rank must be >= 1, got {low_rank}")
        self._num_layers = num_layers
        self._low_rank = low_rank
        self.W_kernels = _InitializedList(
            num_layers, (in_features, low_rank), nn.init.xavier_normal_, device
        )
        self.V_kernels = _InitializedList(
            num_layers, (low_rank, in_features), nn.init.xavier_normal_, device
        )
        self.bias = _InitializedList(num_layers, (in_features,), nn.init.zeros_, device)

    def reset_parameters(self) -> None:
        """Xavier-normal kernels and zero biases; a no-op on `meta`."""
        for params in (self.W_kernels, self.V_kernels, self.bias):
            params.reset_parameters()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x0 = input
        x = x0
        for w, v, b in zip(self.W_kernels, self.V_kernels, self.bias):
            x = x0 * (nn.functional.linear(nn.functional.linear(x, v), w) + b) + x
        return x
