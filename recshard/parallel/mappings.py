"""Communication with autograd for tensor parallelism: each collective is a tiny Function
whose backward is the transposed collective.

    mp_copy            identity        <->  all-reduce
    mp_reduce          all-reduce      <->  identity
    mp_scatter         keep my slice   <->  all-gather
    mp_gather          all-gather      <->  keep my slice
    mp_reduce_scatter  reduce-scatter  <->  all-gather      (sequence parallelism)
    mp_all_gather      all-gather      <->  reduce-scatter  (sequence parallelism)

Conventions: `pg` is the model-parallel group (None: WORLD); tensors that are "replicated"
hold the same value on every rank of `pg` and their gradient is the gradient of one copy.
mp_gather's backward keeps a slice because its output is consumed identically everywhere;
mp_all_gather's backward reduce-scatters because each rank consumes it differently.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor

from recshard.parallel.utils import ProcessGroup, check_dim_size, group_rank, group_size

ReduceOp = Union[str, "dist.ReduceOp.RedOpType"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _op_name(op: ReduceOp) -> str:
    """'sum' | 'avg' | 'max' | 'min' for a string or a dist.ReduceOp member."""
    if isinstance(op, str) and op.lower() in _OPS:
        return op.lower()
    for name, member in _OPS.items():
        if not isinstance(op, str) and op == member:
            return name
    raise ValueError(f"mp_reduce: unsupported reduction op {op!r}; use SUM, AVG, MAX or MIN")


# ----------------------------------------------------------------------------- raw collectives


def all_reduce(x: Tensor, pg: ProcessGroup | None, op: str = "sum") -> Tensor:
    """All-reduce into a new tensor (the input is left untouched). Same shape."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "avg" else _OPS[op], group=pg)
    return out / group_size(pg) if op == "avg" else out


def all_gather(x: Tensor, dim: int, pg: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's `x` along `dim`. [.., n, ..] -> [.., n * ws, ..]."""
    ws = group_size(pg)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((ws * front.shape[0], *front.shape[1:]))
    _all_gather_single(out, front, group=pg)
    return out.movedim(0, dim)


def reduce_scatter(x: Tensor, dim: int, pg: ProcessGroup | None) -> Tensor:
    """Sum over ranks, keep this rank's slice along `dim`. [.., n, ..] -> [.., n / ws, ..]."""
    ws = group_size(pg)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // ws, *front.shape[1:]))
    _reduce_scatter_single(out, front, group=pg)
    return out.movedim(0, dim)


def local_slice(x: Tensor, dim: int, pg: ProcessGroup | None) -> Tensor:
    """This rank's equal slice of `x` along `dim`. [.., n, ..] -> [.., n / ws, ..]."""
    return x.chunk(group_size(pg), dim=dim)[group_rank(pg)].contiguous()


# ----------------------------------------------------------------------------- autograd pairs


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, pg: ProcessGroup | None) -> Tensor:
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return all_reduce(grad, ctx.pg), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, pg: ProcessGroup | None, op: str) -> Tensor:
        ctx.pg, ctx.op = pg, op
        out = all_reduce(x, pg, op)
        if op in ("max", "min"):
            ctx.save_for_backward(x == out)  # the gradient flows to the ranks that won
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        if ctx.op == "avg":
            grad = grad / group_size(ctx.pg)
        elif ctx.op in ("max", "min"):
            grad = grad * ctx.saved_tensors[0]
        return grad, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, pg: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.pg = dim, pg
        return local_slice(x, dim, pg)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return all_gather(grad, ctx.dim, ctx.pg), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, pg: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.pg = dim, pg
        return all_gather(x, dim, pg)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return local_slice(grad, ctx.dim, ctx.pg), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, pg: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.pg = dim, pg
        return reduce_scatter(x, dim, pg)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return all_gather(grad, ctx.dim, ctx.pg), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, pg: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.pg = dim, pg
        return all_gather(x, dim, pg)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return reduce_scatter(grad, ctx.dim, ctx.pg), None, None


# ----------------------------------------------------------------------------- public functions


def mp_copy(x: Tensor, pg: ProcessGroup | None = None) -> Tensor:
    """Enter a parallel region: identity forward, all-reduce (sum) of the gradient backward."""
    return x if group_size(pg) == 1 else _Copy.apply(x, pg)


def mp_reduce(x: Tensor, pg: ProcessGroup | None = None, op: ReduceOp = "sum") -> Tensor:
    """Leave a parallel region: all-reduce forward (SUM, AVG, MAX or MIN), gradient passed
    through backward (divided by the group size for AVG, routed to the winners for MAX/MIN)."""
    name = _op_name(op)
    return x if group_size(pg) == 1 else _Reduce.apply(x, pg, name)


def mp_scatter(x: Tensor, dim: int = -1, pg: ProcessGroup | None = None) -> Tensor:
    """Keep this rank's slice along `dim` forward, all-gather the gradient backward.
    [.., n, ..] -> [.., n / ws, ..]."""
    ws = group_size(pg)
    check_dim_size(x, dim, ws, "mp_scatter")
    return x if ws == 1 else _Scatter.apply(x, dim, pg)


def mp_gather(x: Tensor, dim: int = -1, pg: ProcessGroup | None = None) -> Tensor:
    """All-gather along `dim` forward, keep this rank's slice of the gradient backward.
    [.., n, ..] -> [.., n * ws, ..]; every rank must pass the same shape."""
    if x.dim() == 0:
        raise ValueError("mp_gather: cannot gather 0-d tensors along a dim")
    return x if group_size(pg) == 1 else _Gather.apply(x, dim, pg)


def mp_reduce_scatter(x: Tensor, dim: int = 0, pg: ProcessGroup | None = None) -> Tensor:
    """Sum over ranks and keep this rank's slice along `dim` forward, all-gather backward.
    [.., n, ..] -> [.., n / ws, ..] (leaving a row-parallel layer into sequence parallelism)."""
    ws = group_size(pg)
    check_dim_size(x, dim, ws, "mp_reduce_scatter")
    return x if ws == 1 else _ReduceScatter.apply(x, dim, pg)


def mp_all_gather(x: Tensor, dim: int = 0, pg: ProcessGroup | None = None) -> Tensor:
    """All-gather along `dim` forward, reduce-scatter the gradient backward.
    [.., n, ..] -> [.., n * ws, ..] (entering a column-parallel layer from sequence parallelism)."""
    if x.dim() == 0:
        raise ValueError("mp_all_gather: cannot gather 0-d tensors along a dim")
    return x if group_size(pg) == 1 else _AllGather.apply(x, dim, pg)
