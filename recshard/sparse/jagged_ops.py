"""The jagged kernels recshard runs: fbgemm when it loads, vectorized torch otherwise.

Each function has fbgemm's name and semantics (checked against fbgemm-gpu-cpu 1.8.0, output
dtypes included) and calls `torch.ops.fbgemm.<name>` when fbgemm imports, is enabled and has
a kernel for the tensors' device and dtypes (`recshard.sparse.fbgemm_seam`); otherwise it runs
a pure-torch implementation with the same results. So recshard runs where fbgemm is missing
or does not load against this torch. Row-wise bucketing lives in `recshard.sparse.bucketize`
and is re-exported here with the switch (`use_fbgemm`, `fbgemm_available`).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from recshard.sparse.bucketize import block_bucketize_sparse_features
from recshard.sparse.fbgemm_seam import (
    DISABLE_ENV_VAR,
    INDEX_DTYPES,
    check_1d,
    check_jagged,
    check_permute,
    check_values,
    complete_cumsum,
    fbgemm_available,
    fbgemm_op,
    needs_grad,
    segment_ranges,
    use_fbgemm,
)

__all__ = [
    "DISABLE_ENV_VAR",
    "asynchronous_complete_cumsum",
    "block_bucketize_sparse_features",
    "expand_into_jagged_permute",
    "fbgemm_available",
    "jagged_to_padded_dense",
    "permute_1D_sparse_data",
    "permute_2D_sparse_data",
    "permute_pooled_embs",
    "segment_sum_csr",
    "use_fbgemm",
]


# --------------------------------------------------------------------------- offsets


def asynchronous_complete_cumsum(lengths: Tensor) -> Tensor:
    """Offsets from lengths: `[N] -> [N+1]` (or `[R, N] -> [R, N+1]` row-wise), starting at 0.

    Same dtype as `lengths`. Float inputs: the torch path may differ from fbgemm's in the
    last bits (torch accumulates in higher precision); integer results are identical.
    """
    if lengths.dim() not in (1, 2):
        raise ValueError(
            f"asynchronous_complete_cumsum: lengths must be 1-D or 2-D, "
            f"got shape {tuple(lengths.shape)}"
        )
    supported = lengths.dtype in INDEX_DTYPES + (torch.float16, torch.bfloat16, torch.float32)
    op = fbgemm_op("asynchronous_complete_cumsum", lengths.device, supported)
    if op is not None:
        return op(lengths)
    zeros = lengths.new_zeros(lengths.shape[:-1] + (1,))
    return torch.cat([zeros, torch.cumsum(lengths, -1, dtype=lengths.dtype)], dim=-1)


# --------------------------------------------------------------------------- permutes


def permute_2D_sparse_data(
    permute: Tensor,
    lengths: Tensor,
    values: Tensor,
    weights: Tensor | None = None,
    permuted_lengths_sum: int | None = None,
) -> Tuple[Tensor, Tensor, Tensor | None]:
    """Reorder whole keys (rows) of a key-major jagged layout.

    permute `[F']` (may repeat or drop keys), lengths `[F, B]`, values `[N]`, weights `[N]`
    -> lengths `[F', B]`, values `[N']`, weights `[N']`. `permuted_lengths_sum` (= N')
    saves a device sync. Gradients flow to `weights` through the torch path: fbgemm's
    backward inverts `permute`, which is wrong for repeats and drops (1.8.0 segfaults).
    """
    if lengths.dim() != 2:
        raise ValueError(
            f"permute_2D_sparse_data: lengths must be 2-D [F, B], got shape {tuple(lengths.shape)}"
        )
    check_1d("permute_2D_sparse_data", values=values, weights=weights)
    check_permute(permute, lengths.size(0), "permute_2D_sparse_data")
    check_values("permute_2D_sparse_data", lengths, values, weights)
    supported = (
        lengths.dtype in INDEX_DTYPES
        and values.dtype in INDEX_DTYPES + (torch.float16, torch.bfloat16, torch.float32)
        and (weights is None or weights.dtype in (torch.float16, torch.float32, torch.float64))
        and not needs_grad(values, weights)
    )
    op = fbgemm_op("permute_2D_sparse_data", values.device, supported)
    if op is not None:
        return op(permute.int(), lengths, values, weights, permuted_lengths_sum)
    permuted_lengths = lengths.index_select(0, permute.long())
    per_key = lengths.sum(1)
    gather = segment_ranges(
        complete_cumsum(per_key)[permute.long()], per_key[permute.long()], permuted_lengths_sum
    )
    new_weights = None if weights is None else weights.index_select(0, gather)
    return permuted_lengths, values.index_select(0, gather), new_weights


def permute_1D_sparse_data(
    permute: Tensor,
    lengths: Tensor,
    values: Tensor,
    weights: Tensor | None = None,
    permuted_lengths_sum: int | None = None,
) -> Tuple[Tensor, Tensor, Tensor | None]:
    """Reorder whole segments of a jagged layout.

    permute `[S']` (may repeat or drop), lengths `[S]`, values `[N]`, weights `[N]`
    -> lengths `[S']`, values `[N']`, weights `[N']`; `permuted_lengths_sum` = N'.
    Gradients flow to `weights` through the torch path (fbgemm's op has no backward).
    """
    check_1d("permute_1D_sparse_data", lengths=lengths, values=values, weights=weights)
    check_permute(permute, lengths.numel(), "permute_1D_sparse_data")
    check_values("permute_1D_sparse_data", lengths, values, weights)
    supported = (
        lengths.dtype in INDEX_DTYPES
        and values.dtype in INDEX_DTYPES + (torch.float16, torch.bfloat16, torch.float32)
        and (weights is None or weights.dtype in (torch.float32, torch.float64))
        and not needs_grad(values, weights)
    )
    op = fbgemm_op("permute_1D_sparse_data", values.device, supported)
    if op is not None:
        return op(permute.int(), lengths, values, weights, permuted_lengths_sum)
    permuted_lengths = lengths.index_select(0, permute.long())
    gather = segment_ranges(
        complete_cumsum(lengths)[permute.long()], permuted_lengths, permuted_lengths_sum
    )
    new_weights = None if weights is None else weights.index_select(0, gather)
    return permuted_lengths, values.index_select(0, gather), new_weights


def expand_into_jagged_permute(
    permute: Tensor, input_offsets: Tensor, output_offsets: Tensor, output_size: int
) -> Tensor:
    """Expand a segment permute into an element permute.

    permute `[S]`, input_offsets `[S+1]`, output_offsets `[S+1]` (offsets of the permuted
    segments) -> `[output_size]`, dtype of `input_offsets`: output element
    `output_offsets[i] + j` comes from input element `input_offsets[permute[i]] + j`.
    `output_size` must equal `output_offsets[-1]`. Empty `permute` gives an empty result
    (fbgemm raises there).
    """
    check_1d(
        "expand_into_jagged_permute", input_offsets=input_offsets, output_offsets=output_offsets
    )
    num_segments = input_offsets.numel() - 1
    if permute.numel() != num_segments or output_offsets.numel() != num_segments + 1:
        raise ValueError(
            f"expand_into_jagged_permute: permute has {permute.numel()} entries, input_offsets "
            f"{input_offsets.numel()} and output_offsets {output_offsets.numel()} "
            f"(need S, S+1, S+1)"
        )
    check_permute(permute, num_segments, "expand_into_jagged_permute")
    if output_offsets.device.type == "cpu" and int(output_offsets[-1]) != output_size:
        raise ValueError(
            f"expand_into_jagged_permute: output_size {output_size} != "
            f"output_offsets[-1] {int(output_offsets[-1])}"
        )
    check_jagged("expand_into_jagged_permute", "output_offsets", output_offsets, output_size, True)
    dtype = input_offsets.dtype
    op = fbgemm_op(
        "expand_into_jagged_permute",
        input_offsets.device,
        dtype in INDEX_DTYPES and num_segments > 0,
    )
    if op is not None:
        return op(permute.to(dtype), input_offsets, output_offsets.to(dtype), output_size)
    starts = input_offsets.long()[permute.long()]
    return segment_ranges(starts, output_offsets.diff(), output_size).to(dtype)


# --------------------------------------------------------------------------- dense ops


def permute_pooled_embs(
    pooled_embs: Tensor,
    offset_dim_list: Tensor,
    permute_list: Tensor,
    inv_offset_dim_list: Tensor,
    inv_permute_list: Tensor,
) -> Tensor:
    """Permute column blocks of pooled embeddings, with autograd.

    pooled_embs `[B, D_sum]`; offset_dim_list `[T+1]` column offsets of the T blocks;
    permute_list `[T]`: output block i is input block `permute_list[i]`; inv_offset_dim_list
    `[T+1]` offsets of the permuted blocks; inv_permute_list `[T]` the inverse permutation.
    Returns `[B, D_sum]`. Backward applies the inverse permutation (fbgemm's
    `permute_pooled_embs_auto_grad` with the inv lists; the torch path via the gather's
    gradient, the same for a true permutation; only the torch path's gradient is right when
    `permute_list` repeats or drops blocks).
    """
    if pooled_embs.dim() != 2:
        raise ValueError(
            f"permute_pooled_embs: pooled_embs must be 2-D [B, D_sum], "
            f"got shape {tuple(pooled_embs.shape)}"
        )
    check_permute(permute_list, offset_dim_list.numel() - 1, "permute_pooled_embs")
    for name, dims in (
        ("offset_dim_list", offset_dim_list),
        ("inv_offset_dim_list", inv_offset_dim_list),
    ):
        check_jagged("permute_pooled_embs", name, dims, pooled_embs.size(1), True)
    op = fbgemm_op(
        "permute_pooled_embs_auto_grad", pooled_embs.device, pooled_embs.is_floating_point()
    )
    if op is not None:
        return op(
            pooled_embs,
            offset_dim_list.long(),
            permute_list.long(),
            inv_offset_dim_list.long(),
            inv_permute_list.long(),
        )
    offsets, permute = offset_dim_list.long(), permute_list.long()
    columns = segment_ranges(offsets[permute], offsets[permute + 1] - offsets[permute])
    return pooled_embs.index_select(1, columns)


def segment_sum_csr(batch_size: int, csr_seg: Tensor, values: Tensor) -> Tensor:
    """Sums of consecutive runs of `values` (read flat) whose bounds are `csr_seg * batch_size`.

    csr_seg `[S+1]` -> `[S]`, dtype of values: `out[i] = values.flatten()[csr_seg[i] *
    batch_size : csr_seg[i+1] * batch_size].sum()`, summed in order in the values' dtype.
    Differentiable (through the torch path).
    """
    check_1d("segment_sum_csr", csr_seg=csr_seg)
    if batch_size < 0:
        raise ValueError(f"segment_sum_csr: batch_size must be >= 0, got {batch_size}")
    check_jagged(
        "segment_sum_csr", "csr_seg * batch_size", csr_seg.long() * batch_size, values.numel(), True
    )
    supported = (
        values.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
        and csr_seg.dtype in INDEX_DTYPES
    )
    supported = supported and not needs_grad(values)  # fbgemm's op has no backward
    op = fbgemm_op("segment_sum_csr", values.device, supported)
    if op is not None:
        return op(batch_size, csr_seg, values)
    num_segments = csr_seg.numel() - 1
    if num_segments < 1:
        return values.new_zeros(0)
    bounds = csr_seg.long() * batch_size
    seg_lengths = bounds.diff()
    segment = torch.repeat_interleave(torch.arange(num_segments, device=values.device), seg_lengths)
    elements = bounds[0] + torch.arange(segment.numel(), device=values.device)
    return values.new_zeros(num_segments).index_add_(0, segment, values.reshape(-1)[elements])


def jagged_to_padded_dense(
    values: Tensor, offsets: Tensor, max_length: int, padding_value: float = 0.0
) -> Tensor:
    """Pad (or cut) each bag to `max_length`, with autograd to `values`.

    values `[N]` or `[N, D]`, offsets `[B+1]` -> `[B, max_length]` or `[B, max_length, D]`,
    dtype of values (`padding_value` cast to it, so 0.5 pads an int tensor with 0).
    """
    if values.dim() not in (1, 2):
        raise ValueError(
            f"jagged_to_padded_dense: values must be [N] or [N, D], got shape {tuple(values.shape)}"
        )
    check_1d("jagged_to_padded_dense", offsets=offsets)
    if offsets.numel() == 0:
        raise ValueError("jagged_to_padded_dense: offsets must have B+1 >= 1 entries, got none")
    check_jagged("jagged_to_padded_dense", "offsets", offsets, values.size(0), True)
    supported = offsets.dtype in INDEX_DTYPES and values.dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
    )
    op = fbgemm_op("jagged_to_padded_dense", values.device, supported)
    if op is not None:
        return op(values, [offsets], [max_length], padding_value)
    num_bags, trailing = offsets.numel() - 1, tuple(values.shape[1:])
    padding = torch.tensor(padding_value, device=values.device).to(values.dtype)
    if values.size(0) == 0:
        return padding.expand((num_bags, max_length) + trailing).clone()
    offsets = offsets.long()
    positions = torch.arange(max_length, device=values.device)
    inside = positions < offsets.diff()[:, None]  # [B, L]: slot holds a value
    rows = (offsets[:-1, None] + positions).clamp(0, values.size(0) - 1)
    dense = values[rows.reshape(-1)].reshape((num_bags, max_length) + trailing)
    return torch.where(inside.reshape(inside.shape + (1,) * len(trailing)), dense, padding)
