"""Pooled embeddings `[B, D]` from model-parallel to data-parallel layout by all-to-all
(table-, column-wise sharding): the functions with autograd (TorchRec's `comm_ops` names and
arguments) and the `nn.Module`s over them (TorchRec's `dist_data` names).

Each function issues its collective asynchronously (`request.py`) and returns an `Awaitable`;
`wait()` gives the result joined to autograd, and backward runs the transposed all-to-all.
Notation: W world size, B batch size (B_global = sum over ranks), D embedding dims.
World size 1 returns the input untouched.
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from recshard.comm import buffers, transport
from recshard.comm.args import check, default_group, one_entry_per_rank, per_rank, same_dtype
from recshard.comm.codecs import QuantizedCommCodecs, cast_dtype
from recshard.comm.column_blocks import (
    Block,
    check_blocks,
    chunk_views,
    chunks_from_columns,
    chunks_to_columns,
    columns_from_chunks,
    lay_chunk,
    pack_chunk,
    runs_by_chunk,
    whole_chunks,
)
from recshard.comm.pg import HoldsGroup
from recshard.comm.request import AllToAllV, CommRequest, Pending, decode, issue_all_to_all
from recshard.comm.shm_hooks import Hooks
from recshard.types import Awaitable, NoWait

Callback = Callable[[torch.Tensor], torch.Tensor]


def alltoall_pooled(
    a2a_pooled_embs_tensor: torch.Tensor,
    batch_size_per_rank: List[int],
    dim_sum_per_rank: List[int],
    dim_sum_per_rank_tensor: torch.Tensor | None = None,
    cumsum_dim_sum_per_rank_tensor: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
    column_blocks: Sequence[Block] | None = None,
) -> Awaitable[torch.Tensor]:
    """Pooled embeddings from model-parallel to data-parallel layout.

    `[B_global, D_local_sum]` (rows: every rank's batch, in rank order; columns: the tables
    on this rank) -> `[B_local, sum(dim_sum_per_rank)]` (rows: this rank's batch; columns:
    each rank's tables, in rank order, or the `column_blocks` (rank, first column, width) of
    the ranks' columns in the order given). `batch_size_per_rank[r]` is rank r's batch size.
    The two tensor arguments exist for TorchRec compatibility and are unused.
    """
    pg = default_group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    x = a2a_pooled_embs_tensor
    check(
        x.dim() == 2,
        f"alltoall_pooled: expected a 2-D [B_global, D_local] tensor, got {tuple(x.shape)}",
    )
    one_entry_per_rank(
        "alltoall_pooled",
        world_size,
        batch_size_per_rank=batch_size_per_rank,
        dim_sum_per_rank=dim_sum_per_rank,
    )
    check(
        x.size(0) == sum(batch_size_per_rank),
        f"alltoall_pooled: input has {x.size(0)} rows but batch_size_per_rank "
        f"{batch_size_per_rank} sums to {sum(batch_size_per_rank)}",
    )
    check(
        x.size(1) == dim_sum_per_rank[rank],
        f"alltoall_pooled: rank {rank} input has {x.size(1)} columns but "
        f"dim_sum_per_rank[{rank}] = {dim_sum_per_rank[rank]}",
    )
    blocks = list(column_blocks) if column_blocks is not None else whole_chunks(dim_sum_per_rank)
    if world_size == 1:
        return NoWait(
            x
            if column_blocks is None
            else chunks_to_columns(x.reshape(-1), x.size(0), dim_sum_per_rank, blocks)
        )
    b_local = batch_size_per_rank[rank]
    input_splits = [b * x.size(1) for b in batch_size_per_rank]
    output_splits = [b_local * d for d in dim_sum_per_rank]
    a2a = PooledAllToAll(pg, input_splits, output_splits, codecs, b_local, dim_sum_per_rank, blocks)
    return CommRequest(a2a, x.reshape(-1))


class PooledAllToAll(AllToAllV):
    """`alltoall_pooled`'s collective, laying out the `[B_local, D]` columns as it decodes.

    Without a codec, forward copies this rank's own chunk from the input straight into its
    output columns and, through shared memory, each peer's chunk straight out of the peer's
    segment (one copy per chunk; the backend's receive buffer is laid out after); backward
    packs each chunk of the gradient's columns once, through shared memory straight into the
    input's gradient (its own) or the ring (a peer's). With a codec that only casts (fp16/bf16
    without loss scale) the layout copies cast as they copy: one pass instead of decode, then
    layout. Other codecs encode and decode around plain copies.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        input_splits: List[int],
        output_splits: List[int],
        codecs: QuantizedCommCodecs | None,
        rows: int,
        chunk_widths: Sequence[int],
        blocks: Sequence[Block],
    ) -> None:
        super().__init__(pg, input_splits, output_splits, codecs, name="alltoall_pooled")
        self.rows, self.chunk_widths, self.blocks = rows, list(chunk_widths), list(blocks)
        self.runs = runs_by_chunk(self.blocks)
        self.rank = dist.get_rank(pg)
        self.dtype = torch.float32  # the embeddings' dtype, set by forward

    def _own(self, flat: torch.Tensor, splits: List[int]) -> torch.Tensor:
        """This rank's own chunk `[B_local, D_me]` in `flat`, cut by `splits`."""
        start = sum(splits[: self.rank])
        return flat[start : start + splits[self.rank]].view(self.rows, self.chunk_widths[self.rank])

    def forward(self, x: torch.Tensor) -> Pending:
        self.dtype = x.dtype
        codec = self.codecs.forward if self.codecs else None
        if codec is None:
            return self._forward_laying(x)
        fused = cast_dtype(codec, x.dtype) is not None

        def read(wire: torch.Tensor) -> torch.Tensor:
            flat = wire if fused else decode(wire, codec, x.dtype)
            return columns_from_chunks(flat, self.rows, self.chunk_widths, self.blocks, x.dtype)

        return issue_all_to_all(
            x, self.input_splits, self.output_splits, self.pg, codec, self.name, read
        )

    def _forward_laying(self, x: torch.Tensor) -> Pending:
        """Without a codec: every chunk copied once into the columns, from wherever it is."""
        rows, widths = self.rows, self.chunk_widths
        columns = buffers.take("columns", rows * sum(widths), x.dtype, x.device)
        columns = columns.view(rows, sum(widths))
        lay_chunk(columns, self._own(x, self.input_splits), self.runs.get(self.rank, []))
        laid = {self.rank}

        def place(peer: int, part: torch.Tensor) -> None:
            values = part.view(x.dtype).view(rows, widths[peer])
            lay_chunk(columns, values, self.runs.get(peer, []))
            laid.add(peer)

        def read(received: torch.Tensor) -> torch.Tensor:
            for chunk, values in enumerate(chunk_views(received, rows, widths)):
                if chunk not in laid:
                    lay_chunk(columns, values, self.runs.get(chunk, []))
            return columns

        return issue_all_to_all(
            x,
            self.input_splits,
            self.output_splits,
            self.pg,
            None,
            self.name,
            read,
            hooks=Hooks(skip_self=True, place=place),
        )

    def backward(self, grad: torch.Tensor) -> Pending:
        codec = self.codecs.backward if self.codecs else None
        if codec is None:
            return self._backward_packing(grad, 1)
        wire_dtype = cast_dtype(codec, grad.dtype)
        if wire_dtype is None:  # encode and decode of their own, around plain copies
            flat = chunks_from_columns(grad, self.chunk_widths, self.blocks, grad.dtype)
            return issue_all_to_all(
                flat,
                self.output_splits,
                self.input_splits,
                self.pg,
                codec,
                self.name + "_bwd",
                lambda wire: decode(wire, codec, self.dtype),
            )
        # packed in the wire dtype already: the cast codec's encode then returns it as it is
        wire = chunks_from_columns(grad, self.chunk_widths, self.blocks, wire_dtype)
        return issue_all_to_all(
            wire,
            self.output_splits,
            self.input_splits,
            self.pg,
            codec,
            self.name + "_bwd",
            lambda received: received.to(self.dtype),
        )

    def backward_dividing(self, grad: torch.Tensor, divisor: int) -> Pending | None:
        """Without a codec: the packing copy reads `grad` as it is (an expanded gradient too)
        and divides."""
        if self.codecs is not None and self.codecs.backward is not None:
            return None
        return self._backward_packing(grad, divisor)

    def _backward_packing(self, grad: torch.Tensor, divisor: int) -> Pending:
        """Without a codec: each chunk of `grad` (any strides) packed once and divided. Through
        shared memory this rank's own goes straight into the receive buffer (the input's
        gradient) and a peer's into the ring as the transport writes it; over the backend every
        chunk goes into the send buffer."""
        rows, widths, name = self.rows, self.chunk_widths, self.name + "_bwd"
        wire = buffers.take("columns_bwd", rows * sum(widths), grad.dtype, grad.device)
        out = buffers.take(name, sum(self.input_splits), grad.dtype, grad.device)
        hooks = None
        if transport.skips_copies(self.pg, grad.device):
            own = self._own(out, self.input_splits)
            pack_chunk(grad, own, self.runs.get(self.rank, []), divisor)

            def fill(peer: int, part: torch.Tensor) -> None:
                values = part.view(grad.dtype).view(rows, widths[peer])
                pack_chunk(grad, values, self.runs.get(peer, []), divisor)

            hooks = Hooks(skip_self=True, fill=fill)
        else:
            chunks = chunk_views(wire, rows, widths)
            for chunk, runs in self.runs.items():
                pack_chunk(grad, chunks[chunk], runs, divisor)
        return issue_all_to_all(
            wire, self.output_splits, self.input_splits, self.pg, None, name, out=out, hooks=hooks
        )


def variable_batch_alltoall_pooled(
    a2a_pooled_embs_tensor: torch.Tensor,
    batch_size_per_rank_per_feature: List[List[int]],
    batch_size_per_feature_pre_a2a: List[int],
    emb_dim_per_rank_per_feature: List[List[int]],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """Pooled all-to-all when each rank's batch size differs per feature (VBE).

    Input (flat): for each destination rank r, for each local feature f,
    `batch_size_per_rank_per_feature[r][f]` rows of `emb_dim_per_rank_per_feature[me][f]`.
    Output (flat): for each source rank s, for each of s's features (in order),
    `batch_size_per_feature_pre_a2a[k]` rows of its dim, k counting features over ranks.
    """
    pg = default_group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    x = a2a_pooled_embs_tensor
    dims = emb_dim_per_rank_per_feature
    check(
        len(dims) == world_size and len(batch_size_per_rank_per_feature) == world_size,
        f"variable_batch_alltoall_pooled: emb_dim_per_rank_per_feature ({len(dims)}) and "
        f"batch_size_per_rank_per_feature ({len(batch_size_per_rank_per_feature)}) need one "
        f"entry per rank (world size {world_size})",
    )
    num_features = sum(len(d) for d in dims)
    check(
        len(batch_size_per_feature_pre_a2a) == num_features,
        f"variable_batch_alltoall_pooled: batch_size_per_feature_pre_a2a has "
        f"{len(batch_size_per_feature_pre_a2a)} entries, expected one per feature ({num_features})",
    )
    input_splits = [
        sum(b * d for b, d in zip(batch_size_per_rank_per_feature[r], dims[rank]))
        for r in range(world_size)
    ]
    check(
        x.numel() == sum(input_splits),
        f"variable_batch_alltoall_pooled: input has {x.numel()} elements, the batch sizes "
        f"and dims give {sum(input_splits)}",
    )
    if world_size == 1:
        return NoWait(x)
    pre_a2a = iter(batch_size_per_feature_pre_a2a)
    output_splits = [sum(next(pre_a2a) * d for d in dims[s]) for s in range(world_size)]
    a2a = AllToAllV(pg, input_splits, output_splits, codecs, name="variable_batch_alltoall_pooled")
    return CommRequest(a2a, x.reshape(-1))


def alltoallv(
    inputs: List[torch.Tensor],
    out_split: List[int] | None = None,
    per_rank_split_lengths: List[int] | None = None,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[List[torch.Tensor]]:
    """Pooled all-to-all of a list of local tables; one output tensor per source rank.

    `inputs[i]`: `[B_global, D_i]`, the batch split as evenly as possible over ranks (the
    first `B_global % W` ranks get one more row). `out_split[r]`: rank r's column count
    (or `per_rank_split_lengths[r]` tables of this rank's dim). Output: `[B_local, out_split[r]]`
    per rank r. Unlike the embedding collectives its gradient is never divided.
    """
    pg = default_group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    check(len(inputs) > 0, "alltoallv: needs at least one input tensor")
    same_dtype(inputs, "alltoallv")
    b_global = inputs[0].size(0)
    check(
        all(t.dim() == 2 and t.size(0) == b_global for t in inputs),
        f"alltoallv: inputs must be 2-D with {b_global} rows, "
        f"got {[tuple(t.shape) for t in inputs]}",
    )
    if out_split is not None:
        dims_per_rank = list(out_split)
    elif per_rank_split_lengths is not None:
        dims_per_rank = [n * inputs[0].size(1) for n in per_rank_split_lengths]
    else:
        raise ValueError("alltoallv: pass out_split or per_rank_split_lengths")
    one_entry_per_rank("alltoallv", world_size, out_split=dims_per_rank)
    local = torch.cat(inputs, dim=1)
    check(
        local.size(1) == dims_per_rank[rank],
        f"alltoallv: rank {rank} inputs have {local.size(1)} columns, out_split says "
        f"{dims_per_rank[rank]}",
    )
    if world_size == 1:
        return NoWait([local])
    base, extra = divmod(b_global, world_size)
    batch_size_per_rank = [base + (1 if r < extra else 0) for r in range(world_size)]
    b_local = batch_size_per_rank[rank]
    input_splits = [b * local.size(1) for b in batch_size_per_rank]
    output_splits = [b_local * d for d in dims_per_rank]

    def per_rank(flat: torch.Tensor) -> List[torch.Tensor]:
        return [blk.view(b_local, d) for blk, d in zip(flat.split(output_splits), dims_per_rank)]

    a2a = AllToAllV(pg, input_splits, output_splits, codecs, divide_grad=False, name="alltoallv")
    return CommRequest(a2a, local.reshape(-1), per_rank)  # type: ignore[arg-type]


class PooledEmbeddingsAllToAll(HoldsGroup, nn.Module):
    """`[B_global, dim_sum_per_rank[me]]` -> `[B_local, sum(dim_sum_per_rank)]` (table-wise).

    Example: `dim_sum_per_rank=[2, 1]`, two ranks, `[6, 2]` on rank 0 and `[6, 1]` on rank 1
    give `[3, 3]` on each: columns 0-1 from rank 0, column 2 from rank 1.
    `batch_size_per_rank` (call) supports unequal batches; default `B_global / W` each.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        dim_sum_per_rank: List[int],
        device: torch.device | None = None,
        callbacks: List[Callback] | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self.pg = pg
        self._dim_sum_per_rank = per_rank(
            dim_sum_per_rank, pg, "PooledEmbeddingsAllToAll: dim_sum_per_rank"
        )
        self._callbacks: List[Callback] = list(callbacks or [])
        self._codecs = codecs
        self._column_blocks: List[Block] | None = None

    @property
    def callbacks(self) -> List[Callback]:
        return self._callbacks

    def set_column_order(self, blocks: Sequence[Block]) -> None:
        """Deliver columns as these (rank, first column, width) blocks, in this order, instead
        of rank order: the caller's permute rides on the all-to-all's own copy."""
        self._column_blocks = check_blocks(blocks, self._dim_sum_per_rank)

    def forward(
        self, local_embs: torch.Tensor, batch_size_per_rank: List[int] | None = None
    ) -> Awaitable[torch.Tensor]:
        world_size = dist.get_world_size(self.pg)
        if batch_size_per_rank is None:
            if local_embs.size(0) % world_size:
                raise ValueError(
                    f"PooledEmbeddingsAllToAll: {local_embs.size(0)} rows do not split evenly "
                    f"over {world_size} ranks; pass batch_size_per_rank"
                )
            batch_size_per_rank = [local_embs.size(0) // world_size] * world_size
        awaitable = alltoall_pooled(
            local_embs,
            batch_size_per_rank,
            self._dim_sum_per_rank,
            group=self.pg,
            codecs=self._codecs,
            column_blocks=self._column_blocks,
        )
        awaitable.callbacks.extend(self._callbacks)
        return awaitable


class VariableBatchPooledEmbeddingsAllToAll(HoldsGroup, nn.Module):
    """Pooled all-to-all with a batch size per rank per feature (VBE); flat in and out.

    `emb_dim_per_rank_per_feature[r]`: dims of rank r's features. See
    `variable_batch_alltoall_pooled` for the layouts.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        emb_dim_per_rank_per_feature: List[List[int]],
        device: torch.device | None = None,
        callbacks: List[Callback] | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        world_size = dist.get_world_size(pg)
        if len(emb_dim_per_rank_per_feature) != world_size:
            raise ValueError(
                f"VariableBatchPooledEmbeddingsAllToAll: emb_dim_per_rank_per_feature has "
                f"{len(emb_dim_per_rank_per_feature)} entries, world size is {world_size}"
            )
        self.pg = pg
        self._emb_dims = [list(d) for d in emb_dim_per_rank_per_feature]
        self._callbacks: List[Callback] = list(callbacks or [])
        self._codecs = codecs

    @property
    def callbacks(self) -> List[Callback]:
        return self._callbacks

    def forward(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank_per_feature: List[List[int]],
        batch_size_per_feature_pre_a2a: List[int],
    ) -> Awaitable[torch.Tensor]:
        awaitable = variable_batch_alltoall_pooled(
            local_embs,
            batch_size_per_rank_per_feature,
            batch_size_per_feature_pre_a2a,
            self._emb_dims,
            group=self.pg,
            codecs=self._codecs,
        )
        awaitable.callbacks.extend(self._callbacks)
        return awaitable
