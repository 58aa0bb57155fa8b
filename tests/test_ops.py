"""recshard.sparse.jagged_ops on both backends against plain-Python references: cumsum, permutes,
expand.

References come from fbgemm's documented behaviour and from calling fbgemm-gpu-cpu 1.8.0.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from ops_reference import (  # noqa: F401 - shared references and strategies
    AVAILABLE,
    BACKENDS,
    FAST,
    INDEX_DTYPES,
    keyed_jagged,
    ref_bucketize,
    ref_cumsum,
    ref_expand,
    ref_jagged_to_padded,
    ref_permute_1D,
    ref_permute_2D,
    ref_permute_pooled,
    ref_segment_sum,
    same,
)

from recshard.sparse import jagged_ops as ops

# ---------------------------------------------------------------- cumsum


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0], [3], [1, 0, 2, 5]])
def test_complete_cumsum(fbgemm, dtype, lengths):
    with ops.use_fbgemm(fbgemm):
        same(
            ops.asynchronous_complete_cumsum(torch.tensor(lengths, dtype=dtype)),
            ref_cumsum(lengths),
            dtype,
        )


@pytest.mark.parametrize("fbgemm", BACKENDS)
def test_complete_cumsum_2d_and_float(fbgemm):
    with ops.use_fbgemm(fbgemm):
        same(
            ops.asynchronous_complete_cumsum(torch.tensor([[1, 2], [3, 4]])), [[0, 1, 3], [0, 3, 7]]
        )
        same(
            ops.asynchronous_complete_cumsum(torch.tensor([1.0, 2.0])),
            [0.0, 1.0, 3.0],
            torch.float32,
        )
        with pytest.raises(ValueError, match="1-D or 2-D"):
            ops.asynchronous_complete_cumsum(torch.tensor(3))


# ---------------------------------------------------------------- permutes


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize(
    "permute,lengths",
    [
        ([2, 0, 0], [[1, 2], [0, 3], [2, 0]]),  # repeat + drop
        ([1], [[1, 2], [0, 3], [2, 0]]),  # single key out
        ([], [[1, 2], [0, 3]]),  # nothing out
        ([0], [[4]]),  # F=1, B=1
        ([1, 0], [[0, 0], [0, 0]]),  # all-zero lengths, empty values
    ],
)
def test_permute_2D(fbgemm, dtype, with_weights, permute, lengths):
    total = sum(map(sum, lengths))
    values = [10 * i for i in range(total)]
    weights = [float(i) for i in range(total)] if with_weights else None
    expected = ref_permute_2D(permute, lengths, values, weights)
    args = (
        torch.tensor(permute, dtype=torch.int32),
        torch.tensor(lengths, dtype=dtype),
        torch.tensor(values, dtype=dtype),
        None if weights is None else torch.tensor(weights),
    )
    with ops.use_fbgemm(fbgemm):
        for lengths_sum in (None, len(expected[1])):
            new_lengths, new_values, new_weights = ops.permute_2D_sparse_data(*args, lengths_sum)
            assert new_lengths.shape == (len(permute), len(lengths[0]))
            same(new_lengths, expected[0], dtype)
            same(new_values, expected[1], dtype)
            same(new_weights, expected[2], None if weights is None else torch.float32)


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize(
    "permute", [[1, 0], [1, 1, 0], [1]]
)  # fbgemm's backward breaks on the last two
def test_permute_weights_gradient(fbgemm, permute):
    lengths = [[1, 2], [0, 3]]
    weights = torch.arange(6.0, requires_grad=True)
    # d(sum(new_weights * scale))/d(weights[i]) = sum of scale where weights[i] landed
    _, landed, _ = ref_permute_2D(permute, lengths, list(range(6)), None)
    expected = [float(sum(pos for pos, i in enumerate(landed) if i == k)) for k in range(6)]
    with ops.use_fbgemm(fbgemm):
        _, _, w2 = ops.permute_2D_sparse_data(
            torch.tensor(permute), torch.tensor(lengths), torch.arange(6), weights
        )
        _, _, w1 = ops.permute_1D_sparse_data(
            torch.tensor(permute), torch.tensor(lengths).sum(1), torch.arange(6), weights
        )
    for new_weights in (w2, w1):
        weights.grad = None
        (new_weights * torch.arange(float(len(landed)))).sum().backward()
        assert weights.grad.tolist() == expected


@pytest.mark.parametrize("fbgemm", BACKENDS)
def test_bucketize_and_segment_sum_gradients(fbgemm):
    weights = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    values = torch.arange(6.0, requires_grad=True)
    with ops.use_fbgemm(fbgemm):
        out = ops.block_bucketize_sparse_features(
            torch.tensor([2, 1]),
            torch.tensor([0, 9, 4]),
            False,
            False,
            torch.tensor([5]),
            2,
            weights,
        )
        sums = ops.segment_sum_csr(2, torch.tensor([0, 1, 3]), values)
    (out[2] * torch.tensor([10.0, 20.0, 30.0])).sum().backward()
    assert weights.grad.tolist() == [10.0, 30.0, 20.0]  # new order: ids 0, 4(bag 1), 9
    (sums * torch.tensor([1.0, 2.0])).sum().backward()
    assert values.grad.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize(
    "permute,lengths",
    [
        ([5, 3, 3, 0], [1, 2, 0, 3, 2, 0]),
        ([0], [3]),
        ([], [1, 2]),
        ([1, 0], [0, 0]),
    ],
)
def test_permute_1D(fbgemm, dtype, permute, lengths):
    values = list(range(100, 100 + sum(lengths)))
    weights = [v / 2 for v in values]
    expected = ref_permute_1D(permute, lengths, values, weights)
    with ops.use_fbgemm(fbgemm):
        out = ops.permute_1D_sparse_data(
            torch.tensor(permute),
            torch.tensor(lengths, dtype=dtype),
            torch.tensor(values, dtype=dtype),
            torch.tensor(weights),
        )
    for actual, want, want_dtype in zip(out, expected, (dtype, dtype, torch.float32)):
        same(actual, want, want_dtype)


@pytest.mark.parametrize("fbgemm", BACKENDS)
def test_permute_rejects_bad_input(fbgemm):
    with ops.use_fbgemm(fbgemm):
        with pytest.raises(ValueError, match="index 3 out of range for 3"):
            ops.permute_2D_sparse_data(
                torch.tensor([3]),
                torch.zeros(3, 2, dtype=torch.long),
                torch.zeros(0, dtype=torch.long),
            )
        with pytest.raises(ValueError, match="index -1 out of range"):
            ops.permute_1D_sparse_data(
                torch.tensor([-1]),
                torch.ones(2, dtype=torch.long),
                torch.zeros(2, dtype=torch.long),
            )
        with pytest.raises(ValueError, match="2-D"):
            ops.permute_2D_sparse_data(
                torch.tensor([0]), torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
            )


@given(data=keyed_jagged(), permute=st.lists(st.integers(0, 3), max_size=6))
@FAST
def test_permute_properties(data, permute):
    lengths, values, weights, dtype = data
    permute = [p % len(lengths) for p in permute]
    expected_2d = ref_permute_2D(permute, lengths, values, weights)
    flat = [n for row in lengths for n in row]
    expected_1d = ref_permute_1D(permute, flat, values, weights)
    w = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    for fbgemm in AVAILABLE:
        with ops.use_fbgemm(fbgemm):
            out = ops.permute_2D_sparse_data(
                torch.tensor(permute, dtype=torch.int64),
                torch.tensor(lengths, dtype=dtype),
                torch.tensor(values, dtype=dtype),
                w,
            )
            for actual, want in zip(out, expected_2d):
                same(actual, want)
            out = ops.permute_1D_sparse_data(
                torch.tensor(permute, dtype=torch.int32),
                torch.tensor(flat, dtype=dtype),
                torch.tensor(values, dtype=dtype),
                w,
            )
            for actual, want in zip(out, expected_1d):
                same(actual, want)


# ---------------------------------------------------------------- expand_into_jagged_permute


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize(
    "permute,lengths",
    [
        ([5, 3, 4, 0, 2, 1], [1, 2, 0, 3, 2, 0]),
        ([0], [3]),
        ([0], [0]),
        ([1, 0], [2, 1]),
    ],
)
def test_expand_into_jagged_permute(fbgemm, dtype, permute, lengths):
    in_off = ref_cumsum(lengths)
    out_off = ref_cumsum([lengths[p] for p in permute])
    with ops.use_fbgemm(fbgemm):
        out = ops.expand_into_jagged_permute(
            torch.tensor(permute, dtype=torch.int32),
            torch.tensor(in_off, dtype=dtype),
            torch.tensor(out_off, dtype=dtype),
            out_off[-1],
        )
    same(out, ref_expand(permute, in_off, out_off), dtype)


@pytest.mark.parametrize("fbgemm", BACKENDS)
def test_expand_into_jagged_permute_edges(fbgemm):
    with ops.use_fbgemm(fbgemm):
        empty = torch.zeros(1, dtype=torch.long)
        same(ops.expand_into_jagged_permute(empty[:0], empty, empty, 0), [], torch.int64)
        with pytest.raises(ValueError, match="need S, S\\+1, S\\+1"):
            ops.expand_into_jagged_permute(torch.tensor([0, 0]), empty, empty, 0)
        with pytest.raises(ValueError, match="output_size 2"):
            ops.expand_into_jagged_permute(
                torch.tensor([0]), torch.tensor([0, 3]), torch.tensor([0, 3]), 2
            )
