"""One kernel call per group of tables: per-table Parameters that are views of one flat
storage per group, and fbgemm's CPU TBE kernels over that storage.

Each table keeps its own Parameter (TorchRec's `embedding_bags.<t>.weight`) for state_dict,
optimizers and hooks. `GroupStorage` makes the Parameters of a group views of one flat 1-D
tensor (table after table, row-major), so fbgemm's CPU kernels read every table of the group
in one call (`split_embedding_codegen_forward_cpu`; each feature has its table's offset, dim
and row count) and build one flat dense gradient in one call
(`split_embedding_backward_codegen_dense_cpu`), handed to each table as its slice.

Id bounds: the forward kernel checks every id against its own table's rows and raises
`RuntimeError: Index P is out of bounds: ID, range 0 to ROWS` before writing the bag; the
collections turn that into a ValueError naming table and feature. The kernel does not check
the bag offsets: callers guarantee `0 = offsets[0] <= ... <= offsets[-1] = len(ids)`.

Aliasing is checked per call by comparing the Parameters' data pointers with those recorded
at the last bind (`GroupStorage.current`): one pass of C calls (`map` over the table modules'
parameter dicts and `Tensor.data_ptr`), no Python frame per table. Whatever moved a Parameter
off its flat storage (`.to()`, `load_state_dict(assign=True)`, `weight.data = ...`,
`weight.set_(...)`, a replaced table module, a copy) makes the storage rebuild itself from the
current Parameters (their identity and values kept) on the next call. Hooks on assignment,
`_apply` or `load_state_dict` would not see `.data =` or `set_()`, so the pointers are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from recshard.modules.embedding_configs import DeviceLike
from recshard.sparse import jagged_ops

FBGEMM_SUM = 0  # fbgemm's PoolingMode.SUM (MEAN tables are pooled as SUM, then divided)

# a table module's Parameter read from its parameter dict: `module.weight` would run
# `nn.Module.__getattr__`, a Python frame per table per call
_parameters_of = attrgetter("_parameters")
_weight_slot = itemgetter("weight")


@dataclass(frozen=True)
class KernelLayout:
    """What fbgemm's kernels need to find each feature's table in a group's flat storage:
    per feature (in lookup order), its table's first element (`weights_offsets`, `[F]`), its
    output columns (`dim_offsets`, `[F + 1]` int32) and its table's first row
    (`hash_size_cumsum`, `[F + 1]`, total rows last; features of one table are adjacent)."""

    weights_offsets: torch.Tensor
    dim_offsets: torch.Tensor
    hash_size_cumsum: torch.Tensor
    total_dim: int
    max_dim: int
    total_rows: int

    @staticmethod
    def build(
        rows: Sequence[int], dims: Sequence[int], features_per_table: Sequence[int]
    ) -> KernelLayout:
        first_row = [0]
        first_element = [0]
        for r, d in zip(rows, dims):
            first_row.append(first_row[-1] + r)
            first_element.append(first_element[-1] + r * d)
        per_feature = [t for t, n in enumerate(features_per_table) for _ in range(n)]
        feature_dims = [dims[t] for t in per_feature]
        dim_offsets = [0]
        for d in feature_dims:
            dim_offsets.append(dim_offsets[-1] + d)
        return KernelLayout(
            weights_offsets=torch.tensor(
                [first_element[t] for t in per_feature], dtype=torch.int64, device="cpu"
            ),
            dim_offsets=torch.tensor(dim_offsets, dtype=torch.int32, device="cpu"),
            hash_size_cumsum=torch.tensor(
                [first_row[t] for t in per_feature] + [first_row[-1]],
                dtype=torch.int64,
                device="cpu",
            ),
            total_dim=dim_offsets[-1],
            max_dim=max(dims),
            total_rows=first_row[-1],
        )


def fbgemm_kernels_apply(flat: torch.Tensor | None) -> bool:
    """fbgemm's CPU kernels serve this call: float32 storage on CPU, fbgemm importable, eager
    mode (export / compile trace the per-table path, whose kernels they know)."""
    return (
        flat is not None
        and flat.device.type == "cpu"
        and flat.dtype == torch.float32
        and not torch.compiler.is_compiling()
        and jagged_ops.fbgemm_available()
    )


class GroupStorage:
    """The flat tensor of each group that its tables' Parameters are views of.

    `groups[g]` lists positions in the collection's table list (a group's tables share a
    data type); the lookup order is the groups' tables one after the other. `current(tables)`
    returns the Parameters in lookup order and each group's flat tensor (None for a group
    whose tables no longer share dtype and device), re-binding the Parameters first if any
    moved off its storage."""

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        self._groups = [tuple(g) for g in groups]
        order = [t for g in self._groups for t in g]
        # a tuple even for one table (itemgetter of one index returns the item itself)
        self._order = (
            itemgetter(*order) if len(order) > 1 else itemgetter(slice(order[0], order[0] + 1))
        )
        self._flats: List[torch.Tensor | None] = []
        self._pointers: Tuple[int, ...] = ()

    def allocate(
        self, shapes: Sequence[Tuple[int, int]], dtypes: Sequence[torch.dtype], device: DeviceLike
    ) -> List[torch.Tensor]:
        """Fresh uninitialized tables `[rows, D]` (collection order), each a view of its
        group's flat tensor: one allocation per group."""
        tables: List[torch.Tensor] = [torch.empty(0, device=device)] * len(shapes)
        for group in self._groups:
            sizes = [shapes[t][0] * shapes[t][1] for t in group]
            flat = torch.empty(sum(sizes), dtype=dtypes[group[0]], device=device)
            for t, piece in zip(group, flat.split(sizes)):
                tables[t] = piece.view(shapes[t])
        return tables

    def in_lookup_order(self, params: Sequence[nn.Parameter]) -> Tuple[nn.Parameter, ...]:
        """`params` (collection order) in lookup order."""
        return self._order(tuple(params))

    def current(
        self, tables: nn.ModuleDict
    ) -> Tuple[Tuple[nn.Parameter, ...], List[torch.Tensor | None]]:
        """The tables' Parameters in lookup order and each group's flat tensor; C calls only
        (no Python frame per table)."""
        ordered = self._order(table_weights(tables))
        if tuple(map(torch.Tensor.data_ptr, ordered)) != self._pointers:
            self.bind(table_weights(tables))
        return ordered, self._flats

    def bind(self, params: Sequence[nn.Parameter]) -> None:
        """Make each group's Parameters views of one flat tensor again (a copy of their
        current values when they are not already), keeping the Parameter objects; `params`
        in the collection's table order."""
        self._flats = []
        for group in self._groups:
            members = [params[t] for t in group]
            if len({(p.dtype, p.device) for p in members}) > 1:
                self._flats.append(None)
                continue
            flat = _flat_of(members)
            if flat is None:
                flat = torch.cat([p.detach().reshape(-1) for p in members])
                for p, piece in zip(members, flat.split([p.numel() for p in members])):
                    p.data = piece.view(p.shape)
            self._flats.append(flat)
        self._pointers = tuple(map(torch.Tensor.data_ptr, self._order(tuple(params))))


def _flat_of(members: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The flat 1-D tensor `members` already tile back to back (one storage, contiguous,
    adjacent), or None."""
    first = members[0]
    storage = first.untyped_storage()
    at = first.storage_offset()
    for p in members:
        if (
            not p.is_contiguous()
            or p.untyped_storage().data_ptr() != storage.data_ptr()
            or p.storage_offset() != at
        ):
            return None
        at += p.numel()
    total = at - first.storage_offset()
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,))


def table_weights(tables: nn.ModuleDict) -> Tuple[nn.Parameter, ...]:
    """Each table module's `weight`, in the dict's order."""
    return tuple(map(_weight_slot, map(_parameters_of, tables.values())))


def _table_grads(flat_grad: torch.Tensor, weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each table's gradient, a view of the flat gradient shaped as the table: one C call.
    Tables that do not need one get it too; autograd drops it (their inputs need no grad)."""
    return torch._C._nn.unflatten_dense_tensors(flat_grad, weights)


class GroupedPooledLookup(torch.autograd.Function):
    """`[B, sum of dims]`: each feature's bags pooled from its table, one kernel call.

    Inputs: the layout, the group's flat storage, ids `[N]`, bag offsets `[F * B + 1]`
    (absolute into `ids`), per-id weights or None, then the group's
    Parameters (views of `flat`, listed so autograd hands each its gradient)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        layout: KernelLayout,
        flat: torch.Tensor,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_id_weights: torch.Tensor | None,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        ctx.layout, ctx.shapes = layout, weights
        offsets = offsets.to(ids.dtype)  # the backward kernel takes one index type
        ctx.save_for_backward(flat, ids, offsets, per_id_weights)
        return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
            flat,
            layout.weights_offsets,
            layout.dim_offsets,
            layout.total_dim,
            layout.hash_size_cumsum,
            ids,
            offsets,
            FBGEMM_SUM,
            per_id_weights,
            0,
        )

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor | None, ...]:
        flat, ids, offsets, per_id_weights = ctx.saved_tensors
        layout: KernelLayout = ctx.layout
        grad = grad.contiguous()
        grad_per_id_weights = None
        if ctx.needs_input_grad[4]:
            grad_per_id_weights = torch.ops.fbgemm.split_embedding_codegen_grad_indice_weights_cpu(
                grad,
                flat,
                layout.weights_offsets,
                layout.dim_offsets,
                ids,
                offsets,
                torch.ones(
                    layout.weights_offsets.numel(),
                    dtype=torch.int32,
                    device=layout.weights_offsets.device,
                ),
            )
        table_grads: Sequence[torch.Tensor | None] = (None,) * len(ctx.shapes)
        if any(ctx.needs_input_grad[5:]):
            flat_grad = torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
                grad,
                flat,
                layout.weights_offsets,
                layout.dim_offsets,
                layout.max_dim,
                layout.hash_size_cumsum,
                max(layout.total_rows, 1).bit_length(),
                ids,
                offsets,
                FBGEMM_SUM,
                per_id_weights,
            )
            table_grads = _table_grads(flat_grad, ctx.shapes)
        return (None, None, None, None, grad_per_id_weights, *table_grads)


def grouped_pooled_lookup(
    layout: KernelLayout,
    flat: torch.Tensor,
    weights: Sequence[nn.Parameter],
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_id_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Sum-pooled lookup of a group's features (see `GroupedPooledLookup`)."""
    return GroupedPooledLookup.apply(layout, flat, ids, offsets, per_id_weights, *weights)


class GroupedSequenceLookup(torch.autograd.Function):
    """`[N, D]`: the row of every id in a group's flat storage viewed as one table `[R, D]`
    (`flat_rows`: ids already shifted by their table's first row and bound-checked; torch's
    gather checks them against R). Backward: fbgemm's dense kernel, one call."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        layout: KernelLayout,
        flat: torch.Tensor,
        flat_rows: torch.Tensor,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        bags = torch.arange(flat_rows.numel() + 1, dtype=flat_rows.dtype, device=flat_rows.device)
        ctx.layout, ctx.shapes = layout, weights
        ctx.save_for_backward(flat, flat_rows, bags)
        # torch's row gather: fbgemm's pooled kernel pays per bag, here one bag per id
        return F.embedding(flat_rows, flat.view(-1, layout.max_dim))

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Tuple[torch.Tensor | None, ...]:
        flat, flat_rows, bags = ctx.saved_tensors
        layout: KernelLayout = ctx.layout
        table_grads: Sequence[torch.Tensor | None] = (None,) * len(ctx.shapes)
        if any(ctx.needs_input_grad[3:]):
            flat_grad = torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
                grad.contiguous(),
                flat,
                layout.weights_offsets,
                layout.dim_offsets,
                layout.max_dim,
                layout.hash_size_cumsum,
                max(layout.total_rows, 1).bit_length(),
                flat_rows,
                bags,
                FBGEMM_SUM,
                None,
            )
            table_grads = _table_grads(flat_grad, ctx.shapes)
        return (None, None, None, *table_grads)


def grouped_sequence_lookup(
    layout: KernelLayout,
    flat: torch.Tensor,
    weights: Sequence[nn.Parameter],
    flat_rows: torch.Tensor,
) -> torch.Tensor:
    """Sequence lookup of a group's ids (see `GroupedSequenceLookup`)."""
    return GroupedSequenceLookup.apply(layout, flat, flat_rows, *weights)
