"""Row-wise sharding's id bucketing (`block_bucketize_sparse_features`), fbgemm's name and
semantics, with a torch path that matches it id for id (negative and out-of-block ids
included); on the fbgemm/torch switch of `recshard.sparse.fbgemm_seam`."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from recshard.sparse.fbgemm_seam import (
    INDEX_DTYPES,
    check_1d,
    check_values,
    complete_cumsum,
    fbgemm_op,
    needs_grad,
)

__all__ = ["block_bucketize_sparse_features"]


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
    check_1d(
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
    check_values("block_bucketize_sparse_features", lengths, indices, weights)
    supported = (
        num_features > 0
        and lengths.dtype in INDEX_DTYPES
        and indices.dtype in INDEX_DTYPES
        and (weights is None or weights.dtype in (torch.float32, torch.float64))
        and not needs_grad(weights)
    )  # fbgemm's op has no backward
    op = fbgemm_op("block_bucketize_sparse_features", indices.device, supported)
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
    block = block_sizes.to(device, torch.int64).repeat_interleave(
        bags_per_feature, output_size=num_bags
    )[bag]
    bucket, local = _block_bucket(indices, block, my_size)
    new_bag = bucket * num_bags + bag  # bucket-major, then the original bag
    order = torch.sort(new_bag, stable=True).indices
    new_lengths = torch.bincount(new_bag, minlength=my_size * num_bags).to(lengths.dtype)
    new_weights = None if weights is None else weights[order]
    new_pos = None
    if bucketize_pos:
        position = torch.arange(num_ids, device=device) - complete_cumsum(lengths)[bag]
        new_pos = position[order].to(indices.dtype)
    unbucketize_permute = None
    if sequence:
        unbucketize_permute = (
            torch.empty_like(order)
            .scatter_(0, order, torch.arange(num_ids, device=device))
            .to(indices.dtype)
        )
    return new_lengths, local[order].to(indices.dtype), new_weights, new_pos, unbucketize_permute
