"""The unsharded collections' lookups where fbgemm's grouped CPU kernels do not apply
(`table_groups.py`: other devices or dtypes, `meta`, export), with a backward made for dense
gradients on CPU.

`weight` is one table, or a group's flat storage viewed as one table `[R, D]` (tables of one
dim, ids already shifted to their table's first row and checked) with the group's per-table
Parameters given as `tables`: they get the gradient, each a view of one flat gradient.

Forward is torch's own kernel (`torch.embedding_bag` / `F.embedding`, what `nn.EmbeddingBag`
and `nn.Embedding` run), so outputs are bit for bit torch's. Backward builds the table's dense
gradient `[rows, D]` with one `index_add_` of the output gradient rows, one per id:
the same sums as torch's backward, which first sorts the ids (3-4x slower on CPU for
batches of a few thousand ids; see `benchmarks/modules.py`). Rows hit by several ids may
differ from torch's in the last bits (summation order).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx


def bag_of_each_id(starts: torch.Tensor, num_ids: int) -> torch.Tensor:
    """`[N]` the bag each id belongs to, from bag starts `[B]` (non-decreasing, first 0)."""
    ends = torch.cat([starts[1:], starts.new_full((1,), num_ids)]) if starts.numel() else starts
    return torch.repeat_interleave(
        torch.arange(starts.numel(), device=starts.device), ends - starts, output_size=num_ids
    )


def _grads(
    grad_weight: torch.Tensor, tables: Sequence[torch.Tensor]
) -> Tuple[torch.Tensor | None, ...]:
    """`(grad of weight, *grads of tables)`: all to `weight` without tables, else each table
    its view of `grad_weight` (one C call)."""
    if not tables:
        return (grad_weight,)
    return (None, *torch._C._nn.unflatten_dense_tensors(grad_weight.view(-1), tables))


class _PooledLookup(torch.autograd.Function):
    """`[B, D]` sums of `weight` rows over bags of `ids` (bag b: `ids[starts[b]:starts[b+1]]`),
    each row scaled by its per-id weight when given."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        weight: torch.Tensor,
        ids: torch.Tensor,
        starts: torch.Tensor,
        per_id_weights: torch.Tensor | None,
        *tables: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(weight, ids, starts, per_id_weights)
        ctx.tables = tables
        return torch.embedding_bag(weight, ids, starts, False, 0, False, per_id_weights)[0]

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor | None, ...]:
        weight, ids, starts, per_id_weights = ctx.saved_tensors
        per_id_grad = grad.index_select(0, bag_of_each_id(starts, ids.numel()))  # [N, D]
        grad_weight = grad_per_id_weights = None
        if any(ctx.needs_input_grad[:1] + ctx.needs_input_grad[4:]):
            scaled = (
                per_id_grad if per_id_weights is None else per_id_grad * per_id_weights.unsqueeze(1)
            )
            grad_weight = torch.zeros_like(weight).index_add_(0, ids, scaled)
        if ctx.needs_input_grad[3]:
            grad_per_id_weights = (per_id_grad * weight.index_select(0, ids)).sum(1)
        weight_grads = (
            (None,) * (1 + len(ctx.tables))
            if grad_weight is None
            else _grads(grad_weight, ctx.tables)
        )
        return weight_grads[0], None, None, grad_per_id_weights, *weight_grads[1:]


class _SequenceLookup(torch.autograd.Function):
    """`[N, D]` the `weight` row of every id."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, weight: torch.Tensor, ids: torch.Tensor, *tables: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight_meta = (weight.shape, weight.dtype, weight.device)
        ctx.tables = tables
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        shape, dtype, device = ctx.weight_meta
        # contiguous: a loss such as `values.sum()` hands back an expanded (stride 0) gradient,
        # which index_add_ reads 4x slower than a copy of it
        grad_weight = torch.zeros(shape, dtype=dtype, device=device).index_add_(
            0, ids, grad.contiguous()
        )
        weight_grads = _grads(grad_weight, ctx.tables)
        return weight_grads[0], None, *weight_grads[1:]


def pooled_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    starts: torch.Tensor,
    per_id_weights: torch.Tensor | None = None,
    tables: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Sum pooling of `ids` `[N]` in bags starting at `starts` `[B]`: `[B, D]`."""
    return _PooledLookup.apply(weight, ids, starts, per_id_weights, *tables)


def sequence_lookup(
    weight: torch.Tensor, ids: torch.Tensor, tables: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """One row per id: `[N, D]`."""
    return _SequenceLookup.apply(weight, ids, *tables)
