"""`Perceptron` and `MLP` under TorchRec's names and parameter layout.

`MLP(in_size, layer_sizes)` is a stack of `Perceptron`s (`_linear` then an activation), so
its state_dict keys are TorchRec's (`_mlp.0._linear.weight`, ...) and a TorchRec checkpoint
of a model built from these blocks loads as is.
"""

from __future__ import annotations

from typing import Callable, List

import torch
from torch import nn

from recshard.modules.embedding_configs import DeviceLike

Activation = str | nn.Module | Callable[[torch.Tensor], torch.Tensor]

_NAMED_ACTIVATIONS = {"relu": torch.relu, "sigmoid": torch.sigmoid}


class Perceptron(nn.Module):
    """`activation(linear(x))`: `[B, in_size]` -> `[B, out_size]`."""

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: nn.Module | Callable[[torch.Tensor], torch.Tensor] = torch.relu,
        device: DeviceLike = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._in_size = in_size
        self._out_size = out_size
        self._linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._activation_fn(self._linear(input))


def _resolve(activation: Activation) -> nn.Module | Callable[[torch.Tensor], torch.Tensor]:
    if not isinstance(activation, str):
        return activation
    if activation not in _NAMED_ACTIVATIONS:
        raise ValueError(
            f"MLP activation {activation!r} is not supported; use one of "
            f"{sorted(_NAMED_ACTIVATIONS)}, an nn.Module or a function of a tensor"
        )
    return _NAMED_ACTIVATIONS[activation]


class MLP(nn.Module):
    """Perceptrons of `layer_sizes`: `[B, in_size]` -> `[B, layer_sizes[-1]]`; the last one's
    activation is the identity when `activation_on_last=False`."""

    def __init__(
        self,
        in_size: int,
        layer_sizes: List[int],
        bias: bool = True,
        activation: Activation = torch.relu,
        device: DeviceLike = None,
        dtype: torch.dtype = torch.float32,
        activation_on_last: bool = True,
    ) -> None:
        super().__init__()
        resolved = _resolve(activation)
        sizes = [in_size, *layer_sizes]
        self._mlp = nn.Sequential(
            *[
                Perceptron(
                    sizes[i],
                    sizes[i + 1],
                    bias=bias,
                    activation=resolved
                    if activation_on_last or i < len(layer_sizes) - 1
                    else nn.Identity(),
                    device=device,
                    dtype=dtype,
                )
                for i in range(len(layer_sizes))
            ]
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._mlp(input)

    def linears(self) -> List[nn.Linear]:
        """The perceptrons' linear layers, in order (for tensor-parallel rewrites)."""
        return [perceptron._linear for perceptron in self._mlp]
