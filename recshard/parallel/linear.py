"""Column- and row-parallel linear layers (Megatron-style).

Column-parallel: the weight's output features are split, y_r = x A_r^T + b_r.
Row-parallel: the weight's input features are split, y = sum_r x_r A_r^T + b.
A column-parallel layer without gather followed by a row-parallel layer with
`input_is_parallel=True` is an MLP with one all-reduce forward and one backward.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recshard.comm.pg import HoldsGroup
from recshard.parallel.init import (
    InitMethod,
    MasterParams,
    linear_master_params,
    shard_parameter,
)
from recshard.parallel.mappings import (
    mp_all_gather,
    mp_copy,
    mp_gather,
    mp_reduce,
    mp_reduce_scatter,
    mp_scatter,
)
from recshard.parallel.utils import (
    ProcessGroup,
    ShardSpec,
    divide,
    group_rank,
    group_size,
    unstride,
)

LinearOutput = Tensor | Tuple[Tensor, Tensor | None]


def check_last_dim(x: Tensor, expected: int, owner: str, what: str) -> None:
    """ValueError when the input's last dim is not `expected` (checked before any collective)."""
    if x.dim() == 0 or x.shape[-1] != expected:
        got = "a 0-d tensor" if x.dim() == 0 else f"{x.shape[-1]} (shape {tuple(x.shape)})"
        raise ValueError(f"{owner} expected input with last dim {what}={expected}, got {got}")


def column_parallel_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    pg: ProcessGroup | None,
    sequence_dim: int | None = None,
) -> Tensor:
    """x [*, in] replicated (or sharded on `sequence_dim`) -> y [*, out / ws] on this rank."""
    x = mp_copy(x, pg) if sequence_dim is None else mp_all_gather(x, sequence_dim, pg)
    return F.linear(x, weight, bias)


def row_parallel_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    pg: ProcessGroup | None,
    sequence_dim: int | None = None,
) -> Tensor:
    """x [*, in / ws] -> y [*, out] summed over ranks (or reduce-scattered on `sequence_dim`)."""
    y = F.linear(x, weight)
    if sequence_dim is None:
        y = mp_reduce(y, pg)
    else:
        y = mp_reduce_scatter(y, sequence_dim, pg)
        bias = None if bias is None else mp_copy(bias, pg)  # each rank saw part of the sequence
    return y if bias is None else y + bias


class _FromLinear:
    """`from_linear`: this rank's slice of an existing `nn.Linear` (same outputs)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, pg: ProcessGroup | None = None, **kwargs: Any) -> Any:
        return cls(  # type: ignore[call-arg]
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            pg=pg,
            _weight=linear.weight,
            _bias=linear.bias,
            **kwargs,
        )


class ColumnParallelLinear(_FromLinear, MasterParams, HoldsGroup, nn.Module):
    """Linear layer with output features split across `pg`.

    x [*, in] -> y [*, out] with `gather_output` (all-gathered, replicated), else this rank's
    [*, out / ws]. `stride` > 1 splits the weight into `ws * stride` interleaved chunks
    (e.g. fused QKV: each rank gets its slice of Q, K and V); a gathered output is put back
    in the full layer's feature order. `skip_bias_add` returns `(y, bias)` without adding it.
    `sequence_dim`: the input arrives sharded along that dim (sequence parallelism) and is
    all-gathered forward / reduce-scattered backward instead of copied / all-reduced.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        skip_bias_add: bool = False,
        init_method: InitMethod | None = None,
        stride: int = 1,
        pg: ProcessGroup | None = None,
        *,
        sequence_dim: int | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _weight: Tensor | None = None,
        _bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"{owner}: stride must be a positive int, got {stride!r}")
        self.pg = pg
        self.world_size, self.rank = group_size(pg), group_rank(pg)
        by = f"group size {self.world_size} x stride {stride}" if stride > 1 else ""
        divide(out_features, self.world_size * stride, "out_features", owner, by)
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_rank = out_features // self.world_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.stride, self.sequence_dim = stride, sequence_dim
        if _weight is None:
            _weight, _bias = linear_master_params(
                in_features, out_features, bias, init_method, device, dtype
            )
        spec = ShardSpec(0, self.rank, self.world_size, stride)
        self.weight = shard_parameter(_weight, spec)
        self.bias = shard_parameter(_bias, spec) if bias and _bias is not None else None

    def _gather(self, y: Tensor) -> Tensor:
        return unstride(mp_gather(y, -1, self.pg), -1, self.world_size, self.stride)

    def forward(self, x: Tensor) -> LinearOutput:
        check_last_dim(x, self.in_features, type(self).__name__, "in_features")
        bias = None if self.skip_bias_add else self.bias
        y = column_parallel_linear(x, self.weight, bias, self.pg, self.sequence_dim)
        if self.gather_output:
            y = self._gather(y)
        if not self.skip_bias_add:
            return y
        if self.bias is None or not self.gather_output:
            return y, self.bias
        return y, self._gather(self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features_per_rank} on rank {self.rank} of {self.world_size}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_FromLinear, MasterParams, HoldsGroup, nn.Module):
    """Linear layer with input features split across `pg`.

    x [*, in] (scattered here) or, with `input_is_parallel`, this rank's x [*, in / ws]
    -> y [*, out], all-reduced and replicated. The bias is replicated and added once, after
    the reduction. `skip_bias_add` returns `(y, bias)`. `sequence_dim`: reduce-scatter the
    output along that dim instead of all-reducing it (sequence parallelism).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        init_method: InitMethod | None = None,
        pg: ProcessGroup | None = None,
        *,
        sequence_dim: int | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        _weight: Tensor | None = None,
        _bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.pg = pg
        self.world_size, self.rank = group_size(pg), group_rank(pg)
        divide(in_features, self.world_size, "in_features", type(self).__name__)
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_rank = in_features // self.world_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_dim = sequence_dim
        if _weight is None:
            _weight, _bias = linear_master_params(
                in_features, out_features, bias, init_method, device, dtype
            )
        self.weight = shard_parameter(_weight, ShardSpec(1, self.rank, self.world_size))
        if bias and _bias is not None:
            self.bias: nn.Parameter | None = nn.Parameter(_bias.detach().clone())
        else:
            self.bias = None

    def forward(self, x: Tensor) -> LinearOutput:
        owner = type(self).__name__
        if self.input_is_parallel:
            what = f"in_features/world_size ({self.in_features}/{self.world_size})"
            check_last_dim(x, self.in_features_per_rank, owner, what)
        else:
            check_last_dim(x, self.in_features, owner, "in_features")
            x = mp_scatter(x, -1, self.pg)
        bias = None if self.skip_bias_add else self.bias
        y = row_parallel_linear(x, self.weight, bias, self.pg, self.sequence_dim)
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features_per_rank} on rank {self.rank} "
            f"of {self.world_size}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelClassifier(ColumnParallelLinear):
    """Column-parallel output layer whose logits stay sharded over classes, to feed
    `ParallelCrossEntropyLoss` without gathering. x [*, in] -> logits [*, num_classes / ws]."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = True,
        init_method: InitMethod | None = None,
        pg: ProcessGroup | None = None,
        *,
        sequence_dim: int | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        divide(num_classes, group_size(pg), "num_classes", type(self).__name__)
        super().__init__(
            in_features,
            num_classes,
            bias,
            gather_output=False,
            init_method=init_method,
            pg=pg,
            sequence_dim=sequence_dim,
            device=device,
            dtype=dtype,
        )
        self.num_classes = num_classes
