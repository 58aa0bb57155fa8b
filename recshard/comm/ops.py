"""Embedding collectives with autograd, TorchRec's names and arguments.

Each issues its collective asynchronously and returns an `Awaitable`; `wait()` gives the
result joined to autograd, and backward runs the transposed collective (see `request.py`).
Notation: W world size, B batch size (B_global = sum over ranks), D embedding dims.
World size 1 returns the input untouched.
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch
import torch.distributed as dist

from recshard.comm.codecs import QuantizedCommCodecs, cast_dtype
from recshard.comm.column_blocks import (
    Block,
    chunks_from_columns,
    chunks_to_columns,
    columns_from_chunks,
    whole_chunks,
)
from recshard.comm.request import (
    AllGatherV,
    AllToAllV,
    CommRequest,
    Pending,
    ReduceScatterV,
    decode,
    issue_all_to_all,
)
from recshard.sparse.jagged_ops import asynchronous_complete_cumsum, expand_into_jagged_permute
from recshard.types import Awaitable, NoWait


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _same_dtype(tensors: List[torch.Tensor], what: str) -> None:
    dtypes = sorted({str(t.dtype) for t in tensors})
    _check(len(dtypes) <= 1, f"{what}: all tensors must share one dtype, got {dtypes}")


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
    pg = _group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    x = a2a_pooled_embs_tensor
    _check(
        x.dim() == 2,
        f"alltoall_pooled: expected a 2-D [B_global, D_local] tensor, got {tuple(x.shape)}",
    )
    _check(
        len(batch_size_per_rank) == world_size and len(dim_sum_per_rank) == world_size,
        f"alltoall_pooled: batch_size_per_rank ({len(batch_size_per_rank)}) and dim_sum_per_rank "
        f"({len(dim_sum_per_rank)}) need one entry per rank (world size {world_size})",
    )
    _check(
        x.size(0) == sum(batch_size_per_rank),
        f"alltoall_pooled: input has {x.size(0)} rows but batch_size_per_rank "
        f"{batch_size_per_rank} sums to {sum(batch_size_per_rank)}",
    )
    _check(
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

    Forward copies each received chunk's blocks into the output columns, casting as it copies
    when the codec only casts (fp16/bf16 without loss scale): one pass instead of decode, then
    layout. Backward packs the gradient's columns into the send buffer, casting as it packs: one
    pass instead of layout, then encode. Other codecs encode and decode around plain copies.
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
        self.dtype = torch.float32  # the embeddings' dtype, set by forward

    def forward(self, x: torch.Tensor) -> Pending:
        self.dtype = x.dtype
        codec = self.codecs.forward if self.codecs else None
        fused = cast_dtype(codec, x.dtype) is not None

        def read(wire: torch.Tensor) -> torch.Tensor:
            flat = wire if fused else decode(wire, codec, x.dtype)
            return columns_from_chunks(flat, self.rows, self.chunk_widths, self.blocks, x.dtype)

        return issue_all_to_all(
            x, self.input_splits, self.output_splits, self.pg, codec, self.name, read
        )

    def backward(self, grad: torch.Tensor) -> Pending:
        codec = self.codecs.backward if self.codecs else None
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
        wire = chunks_from_columns(grad, self.chunk_widths, self.blocks, grad.dtype, divisor)
        return issue_all_to_all(
            wire, self.output_splits, self.input_splits, self.pg, None, self.name + "_bwd"
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
    pg = _group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    x = a2a_pooled_embs_tensor
    dims = emb_dim_per_rank_per_feature
    _check(
        len(dims) == world_size and len(batch_size_per_rank_per_feature) == world_size,
        f"variable_batch_alltoall_pooled: emb_dim_per_rank_per_feature ({len(dims)}) and "
        f"batch_size_per_rank_per_feature ({len(batch_size_per_rank_per_feature)}) need one "
        f"entry per rank (world size {world_size})",
    )
    num_features = sum(len(d) for d in dims)
    _check(
        len(batch_size_per_feature_pre_a2a) == num_features,
        f"variable_batch_alltoall_pooled: batch_size_per_feature_pre_a2a has "
        f"{len(batch_size_per_feature_pre_a2a)} entries, expected one per feature ({num_features})",
    )
    input_splits = [
        sum(b * d for b, d in zip(batch_size_per_rank_per_feature[r], dims[rank]))
        for r in range(world_size)
    ]
    _check(
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


def alltoall_sequence(
    a2a_sequence_embs_tensor: torch.Tensor,
    forward_recat_tensor: torch.Tensor,
    backward_recat_tensor: torch.Tensor | None,
    lengths_after_sparse_data_all2all: torch.Tensor,
    input_splits: List[int],
    output_splits: List[int],
    variable_batch_size: bool = False,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """Per-id embeddings back to the ranks that sent the ids: the sparse all-to-all reversed.

    Input `[N_recv, D]`: one row per id of the KJT this rank received, feature-major.
    `lengths_after_sparse_data_all2all`: that KJT's lengths. `input_splits` /
    `output_splits`: ids the sparse all-to-all sent to / received from each rank.
    `forward_recat_tensor` reorders feature-major into rank-major units: with
    `variable_batch_size=False` a unit is one (feature, source rank) block of equal batch
    size (`[F_local * W]`); with True a unit is one bag (`[F_local * sum(B)]`).
    Output `[N_sent, D]`: rows in the order the ids were sent. The backward reorder comes from
    autograd; `backward_recat_tensor` is accepted for TorchRec compatibility.
    """
    pg = _group(group)
    world_size = dist.get_world_size(pg)
    x = a2a_sequence_embs_tensor
    _check(x.dim() == 2, f"alltoall_sequence: expected [N, D] embeddings, got {tuple(x.shape)}")
    _check(
        len(input_splits) == world_size and len(output_splits) == world_size,
        f"alltoall_sequence: input_splits ({len(input_splits)}) and output_splits "
        f"({len(output_splits)}) need one entry per rank (world size {world_size})",
    )
    _check(
        x.size(0) == sum(output_splits),
        f"alltoall_sequence: {x.size(0)} embedding rows but {sum(output_splits)} ids were "
        f"received (output_splits {output_splits})",
    )
    if world_size == 1:
        return NoWait(x)
    units = forward_recat_tensor.numel()
    if units > 0 and x.size(0) > 0:
        lengths = lengths_after_sparse_data_all2all.reshape(units, -1).sum(1)
        in_offsets = asynchronous_complete_cumsum(lengths)
        out_offsets = asynchronous_complete_cumsum(lengths[forward_recat_tensor.long()])
        rows = expand_into_jagged_permute(
            forward_recat_tensor.to(in_offsets.dtype), in_offsets, out_offsets, x.size(0)
        )
        x = x.index_select(0, rows.long())
    dim = x.size(1)
    a2a = AllToAllV(
        pg,
        [n * dim for n in output_splits],
        [n * dim for n in input_splits],
        codecs,
        name="alltoall_sequence",
    )
    return CommRequest(a2a, x.reshape(-1), lambda flat: flat.view(-1, dim))


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
    pg = _group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    _check(len(inputs) > 0, "alltoallv: needs at least one input tensor")
    _same_dtype(inputs, "alltoallv")
    b_global = inputs[0].size(0)
    _check(
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
    _check(
        len(dims_per_rank) == world_size,
        f"alltoallv: out_split {dims_per_rank} needs one entry per rank (world size {world_size})",
    )
    local = torch.cat(inputs, dim=1)
    _check(
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


def reduce_scatter_pooled(
    inputs: List[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """`inputs[r]` summed over ranks lands on rank r (shape of `inputs[r]`, same on every rank)."""
    pg = _group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    _check(
        len(inputs) == world_size,
        f"reduce_scatter_pooled: needs one input per rank ({world_size}), got {len(inputs)}",
    )
    _same_dtype(inputs, "reduce_scatter_pooled")
    if world_size == 1:
        return NoWait(inputs[0])
    shape = inputs[rank].shape
    flat = torch.cat([t.reshape(-1) for t in inputs])
    rs = ReduceScatterV(pg, [t.numel() for t in inputs], codecs, name="reduce_scatter_pooled")
    return CommRequest(rs, flat, lambda out: out.view(shape))


def reduce_scatter_base_pooled(
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """`[W * B, D]` partial sums on every rank -> `[B, D]`: rows `r*B..(r+1)*B`
    summed, on rank r."""
    pg = _group(group)
    world_size = dist.get_world_size(pg)
    _check(
        input.size(0) % world_size == 0,
        f"reduce_scatter_base_pooled: {input.size(0)} rows do not split evenly "
        f"over {world_size} ranks",
    )
    return reduce_scatter_v_pooled(input, [input.size(0) // world_size] * world_size, pg, codecs)


def reduce_scatter_v_pooled(
    input: torch.Tensor,
    input_splits: List[int],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """`[sum(input_splits), D...]` partial sums -> `[input_splits[r], D...]` on rank r: the sum
    over ranks of row block r (uneven batch sizes per rank). Backward: all-gather."""
    pg = _group(group)
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    _check(
        len(input_splits) == world_size,
        f"reduce_scatter_v_pooled: input_splits {input_splits} needs one entry per rank "
        f"(world size {world_size})",
    )
    _check(
        input.size(0) == sum(input_splits),
        f"reduce_scatter_v_pooled: input has {input.size(0)} rows, input_splits "
        f"{input_splits} sum to {sum(input_splits)}",
    )
    if world_size == 1:
        return NoWait(input)
    row = math.prod(input.shape[1:])
    shape = (input_splits[rank], *input.shape[1:])
    rs = ReduceScatterV(pg, [n * row for n in input_splits], codecs, name="reduce_scatter_v_pooled")
    return CommRequest(rs, input.reshape(-1), lambda out: out.view(shape))


def reduce_scatter_v_per_feature_pooled(
    input: torch.Tensor,
    batch_size_per_rank_per_feature: List[List[int]],
    embedding_dims: List[int],
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """Variable batch per feature (VBE) partial pools, flat and rank-major (for each rank r,
    for each feature f, `batch_size_per_rank_per_feature[r][f]` rows of `embedding_dims[f]`)
    -> rank r's chunk summed over ranks, on rank r (flat). Backward: all-gather."""
    pg = _group(group)
    world_size = dist.get_world_size(pg)
    _check(
        len(batch_size_per_rank_per_feature) == world_size,
        f"reduce_scatter_v_per_feature_pooled: batch_size_per_rank_per_feature has "
        f"{len(batch_size_per_rank_per_feature)} entries, world size is {world_size}",
    )
    splits = [
        sum(b * d for b, d in zip(batches, embedding_dims))
        for batches in batch_size_per_rank_per_feature
    ]
    return reduce_scatter_v_pooled(input.reshape(-1), splits, pg, codecs)


def all_gather_base_pooled(
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """`[B, D...]` on every rank -> `[W * B, D...]`, rank blocks in rank order.
    Backward: reduce-scatter (divided by W when gradient division is on, as TorchRec)."""
    pg = _group(group)
    world_size = dist.get_world_size(pg)
    if world_size == 1:
        return NoWait(input)
    shape = (world_size * input.size(0), *input.shape[1:])
    ag = AllGatherV(pg, [input.numel()] * world_size, codecs, name="all_gather_base_pooled")
    return CommRequest(ag, input.reshape(-1), lambda out: out.view(shape))
