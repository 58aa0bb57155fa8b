"""Plain-Python references and strategies for the recshard.sparse.jagged_ops tests
(shared by both files)."""

from __future__ import annotations

from typing import List, Sequence

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

from recshard.sparse import jagged_ops as ops

BACKENDS = [
    pytest.param(
        True,
        id="fbgemm",
        marks=pytest.mark.skipif(not ops.fbgemm_available(), reason="fbgemm_gpu not loadable here"),
    ),
    pytest.param(False, id="torch"),
]
AVAILABLE = [True, False] if ops.fbgemm_available() else [False]
INDEX_DTYPES = [torch.int32, torch.int64]
FAST = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------- plain-Python references


def ref_cumsum(lengths: Sequence[int]) -> List[int]:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def ref_permute_1D(permute, lengths, values, weights):
    offsets = ref_cumsum(lengths)
    new_lengths, new_values, new_weights = [], [], []
    for p in permute:
        new_lengths.append(lengths[p])
        new_values += values[offsets[p] : offsets[p + 1]]
        if weights is not None:
            new_weights += weights[offsets[p] : offsets[p + 1]]
    return new_lengths, new_values, new_weights if weights is not None else None


def ref_permute_2D(permute, lengths_2d, values, weights):
    _, new_values, new_weights = ref_permute_1D(
        permute, [sum(r) for r in lengths_2d], values, weights
    )
    return [lengths_2d[p] for p in permute], new_values, new_weights


def ref_expand(permute, input_offsets, output_offsets):
    out = []
    for i, p in enumerate(permute):
        out += [input_offsets[p] + j for j in range(output_offsets[i + 1] - output_offsets[i])]
    return out


def ref_bucketize(lengths, indices, block_sizes, my_size, weights, bits):
    """fbgemm's rule: ids read as unsigned of their width; out of range -> id % my_size."""
    num_bags = len(lengths)
    batch = num_bags // max(len(block_sizes), 1)
    buckets = [[[] for _ in range(num_bags)] for _ in range(my_size)]
    i = 0
    for bag, n in enumerate(lengths):
        block = block_sizes[bag // batch]
        for pos in range(n):
            u = indices[i] % (1 << bits)
            bucket, local = (
                (u // block, u % block) if u < block * my_size else (u % my_size, u // my_size)
            )
            if local >= 1 << (bits - 1):
                local -= 1 << bits
            buckets[bucket][bag].append((local, None if weights is None else weights[i], pos, i))
            i += 1
    entries = [e for per_bucket in buckets for per_bag in per_bucket for e in per_bag]
    unbucketize = [0] * len(entries)
    for out_pos, e in enumerate(entries):
        unbucketize[e[3]] = out_pos
    return (
        [len(per_bag) for per_bucket in buckets for per_bag in per_bucket],
        [e[0] for e in entries],
        None if weights is None else [e[1] for e in entries],
        [e[2] for e in entries],
        unbucketize,
    )


def ref_permute_pooled(rows, dims, permute):
    offsets = ref_cumsum(dims)
    return [[x for p in permute for x in row[offsets[p] : offsets[p + 1]]] for row in rows]


def ref_segment_sum(batch_size, csr_seg, flat_values):
    return [
        sum(flat_values[csr_seg[i] * batch_size : csr_seg[i + 1] * batch_size])
        for i in range(len(csr_seg) - 1)
    ]


def ref_jagged_to_padded(rows, offsets, max_length, padding, width=None):
    """rows: list of values (scalars, or lists of `width`); result nested lists [B][L](D)."""
    pad = padding if width is None else [padding] * width
    return [
        [
            rows[offsets[b] + j] if j < offsets[b + 1] - offsets[b] else pad
            for j in range(max_length)
        ]
        for b in range(len(offsets) - 1)
    ]


def same(actual: torch.Tensor | None, expected, dtype: torch.dtype | None = None) -> None:
    if expected is None:
        assert actual is None
        return
    assert actual is not None
    if dtype is not None:
        assert actual.dtype == dtype, (actual.dtype, dtype)
    assert actual.tolist() == expected, (actual.tolist(), expected)


# ---------------------------------------------------------------- strategies


@st.composite
def keyed_jagged(draw, max_keys=4, max_batch=4, max_len=4):
    """(lengths [F][B], values, weights or None, index dtype)."""
    num_keys = draw(st.integers(1, max_keys))
    batch = draw(st.integers(1, max_batch))
    lengths = [[draw(st.integers(0, max_len)) for _ in range(batch)] for _ in range(num_keys)]
    total = sum(map(sum, lengths))
    values = draw(st.lists(st.integers(0, 1000), min_size=total, max_size=total))
    weights = draw(
        st.none() | st.lists(st.integers(-50, 50).map(float), min_size=total, max_size=total)
    )
    return lengths, values, weights, draw(st.sampled_from(INDEX_DTYPES))
