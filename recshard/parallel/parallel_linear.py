"""torchshard-style `ParallelLinear`: one class, the split chosen by `dim`.

    dim=None   a plain nn.Linear (replicated)
    dim=1/-1   output features split (column-parallel), output gathered
    dim=0      input features split (row-parallel), input scattered, output reduced

Whatever `dim`, the layer maps x [*, in] -> y [*, out] with the values of the nn.Linear it
was cut from, so `convert_parallel_linear` can swap layers without changing a model.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recshard.comm.pg import HoldsGroup
from recshard.parallel.init import MasterParams, linear_master_params, shard_parameter
from recshard.parallel.linear import check_last_dim, column_parallel_linear, row_parallel_linear
from recshard.parallel.mappings import mp_gather, mp_scatter
from recshard.parallel.utils import (
    ProcessGroup,
    ShardSpec,
    divide,
    group_rank,
    group_size,
)

_VALID_DIMS = (None, 0, 1, -1)


def _check_dim(dim: Any, owner: str) -> int | None:
    if isinstance(dim, bool) or dim not in _VALID_DIMS:
        raise ValueError(f"{owner}: dim must be None, 0, 1 or -1, got {dim!r}")
    return dim


def _check_divisible(
    in_features: int, out_features: int, dim: int | None, world_size: int, owner: str
) -> None:
    if dim == 0:
        divide(in_features, world_size, "in_features", owner)
    elif dim is not None:
        divide(out_features, world_size, "out_features", owner)


class ParallelLinear(MasterParams, HoldsGroup, nn.Module):
    """Linear layer split along `dim` (None, 0, 1 or -1) across `pg`. x [*, in] -> y [*, out].

    The weight keeps nn.Linear's [out, in] layout; this rank holds [out / ws, in] (dim 1/-1,
    bias split too) or [out, in / ws] (dim 0, bias replicated).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dim: int | None = None,
        pg: ProcessGroup | None = None,
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _weight: Tensor | None = None,
        _bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.dim = _check_dim(dim, owner)
        self.pg = pg
        self.world_size = 1 if dim is None else group_size(pg)
        self.rank = 0 if dim is None else group_rank(pg)
        _check_divisible(in_features, out_features, dim, self.world_size, owner)
        self.in_features, self.out_features = in_features, out_features
        if _weight is None:
            _weight, _bias = linear_master_params(
                in_features, out_features, bias, None, device, dtype
            )
        if dim is None:
            self.weight = nn.Parameter(_weight.detach().clone())
        else:
            weight_dim = 1 if dim == 0 else 0
            self.weight = shard_parameter(
                _weight, ShardSpec(weight_dim, self.rank, self.world_size)
            )
        if not bias or _bias is None:
            self.bias: nn.Parameter | None = None
        elif dim in (1, -1):
            self.bias = shard_parameter(_bias, ShardSpec(0, self.rank, self.world_size))
        else:
            self.bias = nn.Parameter(_bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        check_last_dim(x, self.in_features, type(self).__name__, "in_features")
        if self.dim is None:
            return F.linear(x, self.weight, self.bias)
        if self.dim == 0:
            return row_parallel_linear(mp_scatter(x, -1, self.pg), self.weight, self.bias, self.pg)
        return mp_gather(column_parallel_linear(x, self.weight, self.bias, self.pg), -1, self.pg)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dim={self.dim}, world_size={self.world_size}"
        )

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, dim: int | None, pg: ProcessGroup | None = None
    ) -> ParallelLinear:
        """This rank's part of an existing `nn.Linear`, split along `dim` (same outputs)."""
        return cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            dim,
            pg,
            _weight=linear.weight,
            _bias=linear.bias,
        )

    @staticmethod
    def convert_parallel_linear(
        module: nn.Module, dim: int | None, pg: ProcessGroup | None = None
    ) -> nn.Module:
        """Replace every `nn.Linear` in `module` (itself included) by a `ParallelLinear` split
        along `dim`, cut from its current weights: the model's outputs do not change.

        Every layer is checked before any is replaced; a layer that cannot be split raises a
        ValueError naming it. Returns the converted module (a new one if `module` is a Linear).
        Subclasses of nn.Linear are left alone (their forward may differ).
        """
        owner = "ParallelLinear.convert_parallel_linear"
        _check_dim(dim, owner)
        world_size = 1 if dim is None else group_size(pg)
        targets: List[Tuple[str, nn.Linear]] = [
            (name, m) for name, m in module.named_modules() if type(m) is nn.Linear
        ]
        for name, linear in targets:
            label = (
                f"{owner}: layer {name or '<root>'!r} ({linear.in_features}->{linear.out_features})"
            )
            _check_divisible(linear.in_features, linear.out_features, dim, world_size, label)
        converted: Dict[int, ParallelLinear] = {
            id(m): ParallelLinear.from_linear(m, dim, pg) for _, m in targets
        }
        if id(module) in converted:
            return converted[id(module)]
        for parent in list(module.modules()):
            for child_name, child in list(parent.named_children()):
                if id(child) in converted:
                    setattr(parent, child_name, converted[id(child)])
        return module
