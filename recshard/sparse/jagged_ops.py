"""The one seam for jagged kernels: fbgemm when it loads, vectorized torch otherwise.

Every jagged op recshard runs goes through this module. Each function has fbgemm's name
and semantics (checked against fbgemm-gpu-cpu 1.8.0, output dtypes included) and calls
`torch.ops.fbgemm.<name>` when fbgemm imports, is enabled and has a kernel for the
tensors' device and dtypes; otherwise it runs a pure-torch implementation with the same
results. So recshard runs where fbgemm is missing or does not load against this torch.

Switches: `RECSHARD_DISABLE_FBGEMM=1` (read once, at first use; fbgemm is then never
imported) and the `use_fbgemm(False)` context manager (process-wide, all threads).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable, Iterator, Tuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

DISABLE_ENV_VAR = "RECSHARD_DISABLE_FBGEMM"
_INDEX_DTYPES = (torch.int32, torch.int64)
_enabled = True  # flipped by use_fbgemm()


@functools.cache
def fbgemm_available() -> bool:
    """True when `fbgemm_gpu` imports (tried once) and `RECSHARD_DISABLE_FBGEMM` is unset."""
    if os.environ.get(DISABLE_ENV_VAR, "").strip().lower() not in ("", "0", "false"):
        logger.debug("%s is set: jagged ops use the torch path", DISABLE_ENV_VAR)
        return False
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception as e:  # ImportError, OSError from a mismatched .so, ...
        logger.debug(
            "fbgemm_gpu did not load (%s: %s): jagged ops use the torch path", type(e).__name__, e
        )
        return False
    return True


@contextlib.contextmanager
def use_fbgemm(enabled: bool) -> Iterator[None]:
    """Run the block with fbgemm kernels on (`True`, needs fbgemm) or off (torch path)."""
    global _enabled
    if enabled and not fbgemm_available():
        raise RuntimeError(
            f"use_fbgemm(True): fbgemm_gpu is not available "
            f"(not installed, failed to load, or {DISABLE_ENV_VAR} is set)"
        )
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}
# Ops that are composite in fbgemm: look for the kernel of the op they call.
_KERNEL_OF = {"jagged_to_padded_dense": "jagged_to_padded_dense_forward"}


@functools.cache
def _resolve(name: str, device_type: str) -> Callable[..., Any] | None:
    key = _DISPATCH_KEYS.get(device_type)
    if key is None or not fbgemm_available():
        return None
    try:
        op = getattr(torch.ops.fbgemm, name)
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(
            "fbgemm::" + _KERNEL_OF.get(name, name), key
        )
    except Exception as e:  # op missing from this fbgemm build
        logger.debug("fbgemm op %s unavailable (%s): torch path", name, e)
        return None
    if not has_kernel:
        logger.debug("fbgemm op %s has no %s kernel: torch path", name, key)
        return None
    return op


def _fbgemm(name: str, device: torch.device, supported: bool = True) -> Callable[..., Any] | None:
    """fbgemm's op `name` if it should run here (enabled, loaded, kernel for device), else None.

    The op is called with its tensor arguments made contiguous: fbgemm's CPU kernels read a
    tensor's data pointer as a dense array, so a strided view (a KJT built from a slice, a
    column) would be read wrong (`contiguous()` returns a dense tensor unchanged)."""
    if not (_enabled and supported):
        return None
    op = _resolve(name, device.type)
    return None if op is None else functools.partial(_call_dense, op)


def _call_dense(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return op(*(_dense(a) for a in args), **{k: _dense(v) for k, v in kwargs.items()})


def _dense(arg: Any) -> Any:
    if isinstance(arg, Tensor):
        return arg.contiguous()
    if isinstance(arg, (list, tuple)) and any(isinstance(a, Tensor) for a in arg):
        return type(arg)(_dense(a) for a in arg)
    return arg


def _complete_cumsum(lengths: Tensor) -> Tensor:
    """Torch `[N] -> [N+1]` int64 offsets (internal index math)."""
    return torch.cat(
        [lengths.new_zeros(1, dtype=torch.long), torch.cumsum(lengths, 0, dtype=torch.long)]
    )


def _segment_ranges(starts: Tensor, seg_lengths: Tensor, total: int | None = None) -> Tensor:
    """Concatenation of `arange(starts[i], starts[i] + seg_lengths[i])` over i, int64 `[sum]`.

    `total` (= `seg_lengths.sum()`) avoids a device sync when given.
    """
    seg_lengths = seg_lengths.long()
    segment = torch.repeat_interleave(
        torch.arange(seg_lengths.numel(), device=seg_lengths.device), seg_lengths, output_size=total
    )
    out_starts = torch.cumsum(seg_lengths, 0) - seg_lengths
    shift = starts.long() - out_starts
    return shift[segment] + torch.arange(segment.numel(), device=segment.device)


def _needs_grad(*tensors: Tensor | None) -> bool:
    """True when autograd must flow into one of `tensors`."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_permute(permute: Tensor, size: int, what: str) -> None:
    """Range-check a permute on CPU (fbgemm reads out of bounds on bad input; no sync cost)."""
    if permute.dim() != 1:
        raise ValueError(f"{what}: permute must be 1-D, got shape {tuple(permute.shape)}")
    if permute.device.type == "cpu" and permute.numel():
        low, high = int(permute.min()), int(permute.max())
        if low < 0 or high >= size:
            bad = low if low < 0 else high
            raise ValueError(f"{what}: permute index {bad} out of range for {size} segments")


def _check_1d(what: str, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dim() != 1:
            raise ValueError(f"{what}: {name} must be 1-D, got shape {tuple(t.shape)}")


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
    supported = lengths.dtype in _INDEX_DTYPES + (torch.float16, torch.bfloat16, torch.float32)
    op = _fbgemm("asynchronous_complete_cumsum", lengths.device, supported)
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
    _check_1d("permute_2D_sparse_data", values=values, weights=weights)
    _check_permute(permute, lengths.size(0), "permute_2D_sparse_data")
    supported = (
        lengths.dtype in _INDEX_DTYPES
        and values.dtype in _INDEX_DTYPES + (torch.float16, torch.bfloat16, torch.float32)
        and (weights is None or weights.dtype in (torch.float16, torch.float32, torch.float64))
        and not _needs_grad(values, weights)
    )
    op = _fbgemm("permute_2D_sparse_data", values.device, supported)
    if op is not None:
        return op(permute.int(), lengths, values, weights, permuted_lengths_sum)
    permuted_lengths = lengths.index_select(0, permute.long())
    per_key = lengths.sum(1)
    gather = _segment_ranges(
        _complete_cumsum(per_key)[permute.long()], per_key[permute.long()], permuted_lengths_sum
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
    _check_1d("permute_1D_sparse_data", lengths=lengths, values=values, weights=weights)
    _check_permute(permute, lengths.numel(), "permute_1D_sparse_data")
    supported = (
        lengths.dtype in _INDEX_DTYPES
        and values.dtype in _INDEX_DTYPES + (torch.float16, torch.bfloat16, torch.float32)
        and (weights is None or weights.dtype in (torch.float32, torch.float64))
        and not _needs_grad(values, weights)
    )
    op = _fbgemm("permute_1D_sparse_data", values.device, supported)
    if op is not None:
        return op(permute.int(), lengths, values, weights, permuted_lengths_sum)
    permuted_lengths = lengths.index_select(0, permute.long())
    gather = _segment_ranges(
        _complete_cumsum(lengths)[permute.long()], permuted_lengths, permuted_lengths_sum
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
    _check_1d(
        "expand_into_jagged_permute", input_offsets=input_offsets, output_offsets=output_offsets
    )
    num_segments = input_offsets.numel() - 1
    if permute.numel() != num_segments or output_offsets.numel() != num_segments + 1:
        raise ValueError(
            f"expand_into_jagged_permute: permute has {permute.numel()} entries, input_offsets "
            f"{input_offsets.numel()} and output_offsets {output_offsets.numel()} "
            f"(need S, S+1, S+1)"
        )
    _check_permute(permute, num_segments, "expand_into_jagged_permute")
    if output_offsets.device.type == "cpu" and int(output_offsets[-1]) != output_size:
        raise ValueError(
            f"expand_into_jagged_permute: output_size {output_size} != "
            f"output_offsets[-1] {int(output_offsets[-1])}"
        )
    dtype = input_offsets.dtype
    op = _fbgemm(
        "expand_into_jagged_permute",
        input_offsets.device,
        dtype in _INDEX_DTYPES and num_segments > 0,
    )
    if op is not None:
        return op(permute.to(dtype), input_offsets, output_offsets.to(dtype), output_size)
    starts = input_offsets.long()[permute.long()]
    return _segment_ranges(starts, output_offsets.diff(), output_size).to(dtype)


# --------------------------------------------------------------------------- bucketize


def _block_bucket(indices: Tensor, block: Tensor, my_size: int) -> Tuple[Tensor, Tensor]:
    """(bucket, local id) per id, int64, exactly as fbgemm computes them.

    fbgemm reads ids as unsigned of their width: `u < block * my_size` -> bucket `u // block`,
    local id `u % block`; otherwise (so also every negative id) bucket `u % my_size`, local id
    `u // my_size`, cast back to the signed dtype.
    """
    ids = indices.long()
    bits = torch.iinfo(indices.dtype).bits
    if bits < 64:  # unsigned view of a narrower id fits in int64
        ids = ids & ((1 << bits) - 1)
        quotient, remainder = ids.div(my_size, rounding_mode="floor"), ids.remainder(my_size)
    else:
        # u = id + 2**64 for negative ids; with 2**64 = Q * my_size + R:
        # u // my_size = Q + (id + R) // my_size and u % my_size = (id + R) % my_size.
        negative = ids < 0
        q_wrap, r_wrap = divmod(1 << 64, my_size)
        shifted = torch.where(negative, ids + r_wrap, ids)
        quotient = shifted.div(my_size, rounding_mode="floor")
        remainder = shifted.remainder(my_size)
        if my_size > 1:  # (q + (Q - 1)) + 1 never overflows; my_size == 1 keeps the id
            quotient = torch.where(negative, quotient + (q_wrap - 1) + 1, quotient)
    in_range = (ids >= 0) & (quotient < block)  # u < block * my_size, without overflow
    safe_block = block.clamp(min=1)
    bucket = torch.where(in_range, ids.div(safe_block, rounding_mode="floor"), remainder)
    local = torch.where(in_range, ids.remainder(safe_block), quotient)
    return bucket, local


def block_bucketize_sparse_features(
    lengths: Tensor,
    indices: Tensor,
    bucketize_pos: bool,
    sequence: bool,
    block_sizes: Tensor,
    my_size: int,
    weights: Tensor | None = None,
    batch_size_per_feature: Tensor | None = None,
    max_B: int = -1,
) -> Tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Split every bag of ids into `my_size` buckets by row block (row-wise sharding).

    lengths `[F*B]` (key-major), indices `[N]`, block_sizes `[F]`, weights `[N]` ->
    new_lengths `[my_size*F*B]` bucket-major (`[bucket0: f0(B) f1(B)..; bucket1: ..]`),
    new_indices `[N]`, new_weights `[N]` (if weights), new_pos `[N]` (if `bucketize_pos`:
    each id's position in its original bag, dtype of indices), unbucketize_permute `[N]`
    (if `sequence`: for each original id, its index in new_indices; dtype of indices).
    A variable batch per feature (fbgemm's arguments): `batch_size_per_feature` `[F]` bags
    per feature (lengths `[sum of them]`), `max_B` the largest.
    Id `i` of feature f goes to bucket `i // block_sizes[f]` as local row
    `i % block_sizes[f]`; ids at or past `my_size * block` (and negative ids, read as
    unsigned like fbgemm) go to bucket `i % my_size` as `i // my_size`. Bag order is kept.
    """
    _check_1d(
        "block_bucketize_sparse_features",
        lengths=lengths,
        indices=indices,
        block_sizes=block_sizes,
        weights=weights,
    )
    num_features, num_bags = block_sizes.numel(), lengths.numel()
    if my_size < 1:
        raise ValueError(f"block_bucketize_sparse_features: my_size must be >= 1, got {my_size}")
    if batch_size_per_feature is not None:
        if int(batch_size_per_feature.sum()) != num_bags:
            raise ValueError(
                f"block_bucketize_sparse_features: batch_size_per_feature "
                f"{batch_size_per_feature.tolist()} sums to {int(batch_size_per_feature.sum())}, "
                f"not the {num_bags} lengths"
            )
    elif (num_bags % num_features if num_features else num_bags) != 0:
        raise ValueError(
            f"block_bucketize_sparse_features: {num_bags} lengths do not split "
            f"into {num_features} features (block_sizes)"
        )
    supported = (
        num_features > 0
        and lengths.dtype in _INDEX_DTYPES
        and indices.dtype in _INDEX_DTYPES
        and (weights is None or weights.dtype in (torch.float32, torch.float64))
        and not _needs_grad(weights)
    )  # fbgemm's op has no backward
    op = _fbgemm("block_bucketize_sparse_features", indices.device, supported)
    if op is not None:
        return op(
            lengths,
            indices,
            bucketize_pos,
            sequence,
            block_sizes.to(indices.dtype),
            my_size,
            weights,
            None if batch_size_per_feature is None else batch_size_per_feature.to(lengths.dtype),
            max_B,
        )
    device, num_ids = indices.device, indices.numel()
    bags_per_feature = (
        batch_size_per_feature.to(device).long()
        if batch_size_per_feature is not None
        else (num_bags // num_features if num_features else 0)
    )
    bag = torch.repeat_interleave(
        torch.arange(num_bags, device=device), lengths.long(), output_size=num_ids
    )
    block = block_sizes.long().repeat_interleave(bags_per_feature, output_size=num_bags)[bag]
    bucket, local = _block_bucket(indices, block, my_size)
    new_bag = bucket * num_bags + bag  # bucket-major, then the original bag
    order = torch.sort(new_bag, stable=True).indices
    new_lengths = torch.bincount(new_bag, minlength=my_size * num_bags).to(lengths.dtype)
    new_weights = None if weights is None else weights[order]
    new_pos = None
    if bucketize_pos:
        position = torch.arange(num_ids, device=device) - _complete_cumsum(lengths)[bag]
        new_pos = position[order].to(indices.dtype)
    unbucketize_permute = None
    if sequence:
        unbucketize_permute = (
            torch.empty_like(order)
            .scatter_(0, order, torch.arange(num_ids, device=device))
            .to(indices.dtype)
        )
    return new_lengths, local[order].to(indices.dtype), new_weights, new_pos, unbucketize_permute


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
    _check_permute(permute_list, offset_dim_list.numel() - 1, "permute_pooled_embs")
    op = _fbgemm(
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
    columns = _segment_ranges(offsets[permute], offsets[permute + 1] - offsets[permute])
    return pooled_embs.index_select(1, columns)


def segment_sum_csr(batch_size: int, csr_seg: Tensor, values: Tensor) -> Tensor:
    """Sums of consecutive runs of `values` (read flat) whose bounds are `csr_seg * batch_size`.

    csr_seg `[S+1]` -> `[S]`, dtype of values: `out[i] = values.flatten()[csr_seg[i] *
    batch_size : csr_seg[i+1] * batch_size].sum()`, summed in order in the values' dtype.
    Differentiable (through the torch path).
    """
    _check_1d("segment_sum_csr", csr_seg=csr_seg)
    supported = (
        values.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
        and csr_seg.dtype in _INDEX_DTYPES
    )
    supported = supported and not _needs_grad(values)  # fbgemm's op has no backward
    op = _fbgemm("segment_sum_csr", values.device, supported)
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
    _check_1d("jagged_to_padded_dense", offsets=offsets)
    if offsets.numel() == 0:
        raise ValueError("jagged_to_padded_dense: offsets must have B+1 >= 1 entries, got none")
    supported = offsets.dtype in _INDEX_DTYPES and values.dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
    )
    op = _fbgemm("jagged_to_padded_dense", values.device, supported)
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
