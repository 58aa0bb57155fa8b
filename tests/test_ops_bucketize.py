"""recshard.sparse.jagged_ops on both backends: bucketize, pooled permute, segment sum, padded
dense, and the fbgemm/torch switch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
from torch.utils._python_dispatch import TorchDispatchMode

from recshard.sparse import jagged_ops as ops

# ---------------------------------------------------------------- block_bucketize_sparse_features


def _bucketize(lengths, indices, block_sizes, my_size, weights, dtype, lengths_dtype=None):
    return ops.block_bucketize_sparse_features(
        torch.tensor(lengths, dtype=lengths_dtype or dtype),
        torch.tensor(indices, dtype=dtype),
        True,
        True,
        torch.tensor(block_sizes, dtype=torch.int64),
        my_size,
        None if weights is None else torch.tensor(weights),
    )


def _check_bucketize(
    out, lengths, indices, block_sizes, my_size, weights, dtype, lengths_dtype=None
):
    expected = ref_bucketize(
        lengths, indices, block_sizes, my_size, weights, torch.iinfo(dtype).bits
    )
    new_lengths, new_indices, new_weights, new_pos, unbucketize = out
    assert new_lengths.shape == (my_size * len(lengths),)
    same(new_lengths, expected[0], lengths_dtype or dtype)
    same(new_indices, expected[1], dtype)
    same(new_weights, expected[2], None if weights is None else torch.float32)
    same(new_pos, expected[3], dtype)
    same(unbucketize, expected[4], dtype)


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_bucketize_design_example(fbgemm, dtype):
    """ids f0=[[0,9],[4]], block 5, 2 buckets -> bucket0 [0],[4]; bucket1 [4],[] (9 -> 4)."""
    with ops.use_fbgemm(fbgemm):
        out = _bucketize([2, 1], [0, 9, 4], [5], 2, [1.0, 2.0, 3.0], dtype)
    same(out[0], [1, 1, 1, 0], dtype)
    same(out[1], [0, 4, 4], dtype)
    same(out[2], [1.0, 3.0, 2.0], torch.float32)
    same(out[3], [0, 0, 1], dtype)  # position in the original bag
    same(out[4], [0, 2, 1], dtype)  # original id i sits at out[4][i] in the bucketized ids


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_bucketize_variable_batch_per_feature(fbgemm, dtype):
    """A batch size per feature (f0: 2 bags, f1: 3), blocks 5 and 3, 2 buckets: each bucket
    holds every bag of every feature, f0's then f1's (fbgemm's layout); f1's id 7 is past
    2 blocks: bucket 7 % 2 as row 7 // 2."""
    with ops.use_fbgemm(fbgemm):
        lengths, ids, weights, _, _ = ops.block_bucketize_sparse_features(
            torch.tensor([2, 1, 1, 0, 3], dtype=dtype),
            torch.tensor([0, 5, 3, 7, 1, 5, 4], dtype=dtype),
            False,
            False,
            torch.tensor([5, 3]),
            2,
            torch.arange(7, dtype=torch.float32),
            batch_size_per_feature=torch.tensor([2, 3]),
            max_B=3,
        )
    same(lengths, [1, 1, 0, 0, 1, 1, 0, 1, 0, 2], dtype)
    same(ids, [0, 3, 1, 0, 3, 2, 1], dtype)
    same(weights, [0.0, 2.0, 4.0, 1.0, 3.0, 5.0, 6.0], torch.float32)
    with pytest.raises(ValueError, match=r"batch_size_per_feature \[2, 2\] sums to 4"):
        ops.block_bucketize_sparse_features(
            torch.tensor([2, 1, 1, 0, 3], dtype=dtype),
            torch.tensor([0, 5, 3, 7, 1, 5, 4], dtype=dtype),
            False,
            False,
            torch.tensor([5, 3]),
            2,
            batch_size_per_feature=torch.tensor([2, 2]),
        )


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_bucketize_out_of_range_ids(fbgemm, dtype):
    """Ids >= my_size * block go to bucket id % my_size as id // my_size (fbgemm's rule);
    negative ids are read as unsigned, so they are out of range too."""
    with ops.use_fbgemm(fbgemm):
        out = _bucketize([3, 2], [0, 12, 27, 4, 100], [5], 2, None, dtype)
        same(out[0], [2, 2, 1, 0], dtype)
        same(out[1], [0, 6, 4, 50, 13], dtype)  # 12 -> b0:6, 27 -> b1:13, 100 -> b0:50
        out = _bucketize([2], [-1, -4], [5], 3, None, dtype)
        big = (1 << torch.iinfo(dtype).bits) - 1  # -1 as unsigned; divisible by 3
        same(out[0], [2, 0, 0], dtype)
        same(out[1], [big // 3, (big - 3) // 3], dtype)
    for my_size in (1, 2, 3, 4):
        with ops.use_fbgemm(fbgemm):
            out = _bucketize([4], [-1, -7, 2**31 - 1, -(2**31)], [3], my_size, None, dtype)
        _check_bucketize(out, [4], [-1, -7, 2**31 - 1, -(2**31)], [3], my_size, None, dtype)


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize(
    "case",
    [
        dict(lengths=[0, 0, 0, 0], indices=[], block_sizes=[5, 3], my_size=3),  # empty values
        dict(lengths=[1, 2, 0, 1], indices=[3, 7, 1, 2], block_sizes=[4, 1], my_size=3),
        dict(lengths=[3], indices=[0, 12, 27], block_sizes=[5], my_size=1),  # one bucket
        dict(lengths=[2, 2], indices=[0, 7, 3, 1], block_sizes=[0], my_size=2),  # block 0
        dict(lengths=[], indices=[], block_sizes=[], my_size=2),  # no features
    ],
)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("with_weights", [False, True])
def test_bucketize_edges(fbgemm, case, dtype, with_weights):
    weights = [float(i) + 0.5 for i in range(len(case["indices"]))] if with_weights else None
    for lengths_dtype in INDEX_DTYPES:  # lengths and ids may differ in dtype
        with ops.use_fbgemm(fbgemm):
            out = _bucketize(
                case["lengths"],
                case["indices"],
                case["block_sizes"],
                case["my_size"],
                weights,
                dtype,
                lengths_dtype,
            )
        _check_bucketize(
            out,
            case["lengths"],
            case["indices"],
            case["block_sizes"],
            case["my_size"],
            weights,
            dtype,
            lengths_dtype,
        )


@pytest.mark.parametrize("fbgemm", BACKENDS)
def test_bucketize_optional_outputs_and_errors(fbgemm):
    with ops.use_fbgemm(fbgemm):
        out = ops.block_bucketize_sparse_features(
            torch.tensor([2]), torch.tensor([1, 6]), False, False, torch.tensor([5]), 2
        )
        assert out[2] is None and out[3] is None and out[4] is None
        with pytest.raises(ValueError, match="my_size must be >= 1"):
            ops.block_bucketize_sparse_features(
                torch.tensor([2]), torch.tensor([1, 6]), False, False, torch.tensor([5]), 0
            )
        with pytest.raises(ValueError, match="3 lengths do not split into 2"):
            ops.block_bucketize_sparse_features(
                torch.tensor([1, 1, 0]), torch.tensor([1, 6]), False, False, torch.tensor([5, 5]), 2
            )


@given(
    data=keyed_jagged(max_len=5),
    my_size=st.integers(1, 4),
    blocks=st.lists(st.integers(1, 9), min_size=4, max_size=4),
    id_shift=st.integers(-5, 20),
)
@FAST
def test_bucketize_properties(data, my_size, blocks, id_shift):
    lengths, values, weights, dtype = data
    flat = [n for row in lengths for n in row]
    indices = [v % 40 - id_shift for v in values]  # some negative, some past the last block
    block_sizes = blocks[: len(lengths)]
    for fbgemm in AVAILABLE:
        with ops.use_fbgemm(fbgemm):
            out = _bucketize(flat, indices, block_sizes, my_size, weights, dtype)
        _check_bucketize(out, flat, indices, block_sizes, my_size, weights, dtype)
        # Property, independent of the reference: through unbucketize_permute, every in-range
        # id comes back as bucket * block + local id.
        unbucketize = out[4].long()
        bucket = torch.arange(my_size).repeat_interleave(out[0].view(my_size, -1).sum(1))[
            unbucketize
        ]
        block = torch.tensor(block_sizes).repeat_interleave(len(lengths[0]))
        block = block.repeat_interleave(torch.tensor(flat, dtype=torch.long))
        ids = torch.tensor(indices)
        in_range = (ids >= 0) & (ids < block * my_size)
        rebuilt = bucket * block + out[1].long()[unbucketize]
        assert torch.equal(rebuilt[in_range], ids[in_range])


# ---------------------------------------------------------------- permute_pooled_embs


def _pooled_args(dims, permute):
    offsets = ref_cumsum(dims)
    inverse = [permute.index(i) for i in range(len(permute))]
    inv_offsets = ref_cumsum([dims[p] for p in permute])
    return [torch.tensor(x) for x in (offsets, permute, inv_offsets, inverse)]


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,dims,permute",
    [
        (2, [1, 2, 3], [2, 0, 1]),
        (1, [4], [0]),
        (0, [2, 3], [1, 0]),
        (3, [2, 2, 1, 5], [3, 1, 0, 2]),
    ],
)
def test_permute_pooled_embs(fbgemm, dtype, batch, dims, permute):
    pooled = torch.arange(batch * sum(dims), dtype=dtype).view(batch, sum(dims)).requires_grad_()
    with ops.use_fbgemm(fbgemm):
        out = ops.permute_pooled_embs(pooled, *_pooled_args(dims, permute))
    same(out, ref_permute_pooled(pooled.tolist(), dims, permute), dtype)
    grad = torch.randn(out.shape).to(dtype)
    out.backward(grad)
    inverse = [permute.index(i) for i in range(len(permute))]
    permuted_dims = [dims[p] for p in permute]
    same(pooled.grad, ref_permute_pooled(grad.tolist(), permuted_dims, inverse), dtype)


@given(
    batch=st.integers(0, 3),
    dims=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    data=st.data(),
)
@FAST
def test_permute_pooled_embs_properties(batch, dims, data):
    permute = data.draw(st.permutations(range(len(dims))))
    pooled = torch.arange(batch * sum(dims), dtype=torch.float32).view(batch, sum(dims))
    for fbgemm in AVAILABLE:
        with ops.use_fbgemm(fbgemm):
            same(
                ops.permute_pooled_embs(pooled, *_pooled_args(dims, permute)),
                ref_permute_pooled(pooled.tolist(), dims, permute),
                torch.float32,
            )


# ---------------------------------------------------------------- segment_sum_csr


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize(
    "batch_size,csr_seg,num_values",
    [
        (2, [0, 2, 3, 6], 12),
        (1, [0, 2, 3, 6], 6),
        (2, [3, 4, 6], 12),
        (2, [0, 2, 2, 6], 12),
        (3, [0, 1, 2], 12),
        (2, [0], 0),
        (1, [0, 0], 0),
    ],
)
def test_segment_sum_csr(fbgemm, dtype, batch_size, csr_seg, num_values):
    values = torch.arange(num_values).to(dtype)
    with ops.use_fbgemm(fbgemm):
        out = ops.segment_sum_csr(batch_size, torch.tensor(csr_seg, dtype=torch.int32), values)
        same(out, ref_segment_sum(batch_size, csr_seg, values.tolist()), dtype)
        if num_values:  # values are read flat, whatever their shape
            same(
                ops.segment_sum_csr(batch_size, torch.tensor(csr_seg), values.view(-1, 2)),
                out.tolist(),
                dtype,
            )


@given(
    batch_size=st.integers(1, 3),
    seg_lengths=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    values=st.lists(st.integers(-100, 100), min_size=60, max_size=60),
)
@FAST
def test_segment_sum_csr_properties(batch_size, seg_lengths, values):
    csr_seg = ref_cumsum(seg_lengths)
    flat = torch.tensor(values, dtype=torch.float32)
    for fbgemm in AVAILABLE:
        with ops.use_fbgemm(fbgemm):
            if csr_seg[-1] * batch_size > len(values):  # fbgemm alone would read past the end
                with pytest.raises(ValueError, match="past the 60 given"):
                    ops.segment_sum_csr(batch_size, torch.tensor(csr_seg), flat)
                continue
            out = ops.segment_sum_csr(batch_size, torch.tensor(csr_seg), flat)
        want = ref_segment_sum(batch_size, csr_seg, values)
        same(out, [float(x) for x in want], torch.float32)


# ---------------------------------------------------------------- jagged_to_padded_dense


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("width", [None, 2])
@pytest.mark.parametrize(
    "offsets,max_length",
    [
        ([0, 2, 2, 6], 3),
        ([0, 2, 2, 6], 0),
        ([0, 2, 2, 6], 5),
        ([1, 3, 4], 3),
        ([0, 0, 0], 2),
        ([0], 2),
        ([0, 6], 6),
    ],
)
def test_jagged_to_padded_dense(fbgemm, dtype, width, offsets, max_length):
    num_rows = 6 if offsets[-1] else 0
    values = torch.arange(num_rows * (width or 1)).to(dtype)
    if width:
        values = values.view(num_rows, width)
    padding = -1.5
    pad = int(padding) if not dtype.is_floating_point else padding
    with ops.use_fbgemm(fbgemm):
        out = ops.jagged_to_padded_dense(values, torch.tensor(offsets), max_length, padding)
    assert out.shape == (len(offsets) - 1, max_length) + ((width,) if width else ())
    same(out, ref_jagged_to_padded(values.tolist(), offsets, max_length, pad, width), dtype)


@pytest.mark.parametrize("fbgemm", BACKENDS)
def test_jagged_to_padded_dense_gradient(fbgemm):
    values = torch.arange(12.0).view(6, 2).requires_grad_()
    with ops.use_fbgemm(fbgemm):
        out = ops.jagged_to_padded_dense(values, torch.tensor([0, 2, 2, 6], dtype=torch.int32), 3)
    out.sum().backward()
    assert values.grad.tolist() == [[1.0, 1.0]] * 5 + [[0.0, 0.0]]  # row 5 was cut


@given(data=keyed_jagged(max_keys=1, max_batch=5), max_length=st.integers(0, 5))
@FAST
def test_jagged_to_padded_dense_properties(data, max_length):
    (lengths,), values, _, dtype = data
    offsets = ref_cumsum(lengths)
    for fbgemm in AVAILABLE:
        with ops.use_fbgemm(fbgemm):
            out = ops.jagged_to_padded_dense(
                torch.tensor(values, dtype=dtype),
                torch.tensor(offsets, dtype=dtype),
                max_length,
                7.0,
            )
        same(out, ref_jagged_to_padded(values, offsets, max_length, 7), dtype)


# ---------------------------------------------------------------- the switch


class _RecordNamespaces(TorchDispatchMode):
    """Records the namespace of every op the dispatcher runs (aten, fbgemm, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.namespaces: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.namespaces.add(func.namespace)
        return func(*args, **(kwargs or {}))


def _run_every_op() -> None:
    lengths = torch.tensor([[1, 2], [0, 3]])
    ops.asynchronous_complete_cumsum(lengths.view(-1))
    ops.permute_2D_sparse_data(torch.tensor([1, 0]), lengths, torch.arange(6), torch.ones(6))
    ops.permute_1D_sparse_data(torch.tensor([1, 0]), lengths.view(-1)[:2], torch.arange(3))
    ops.expand_into_jagged_permute(
        torch.tensor([1, 0]), torch.tensor([0, 1, 3]), torch.tensor([0, 2, 3]), 3
    )
    ops.block_bucketize_sparse_features(
        lengths.view(-1), torch.arange(6), True, True, torch.tensor([3, 3]), 2, torch.ones(6)
    )
    ops.permute_pooled_embs(torch.ones(2, 3), *_pooled_args([1, 2], [1, 0]))
    ops.segment_sum_csr(1, torch.tensor([0, 2, 3]), torch.ones(3))
    ops.jagged_to_padded_dense(torch.ones(3), torch.tensor([0, 1, 3]), 2)


@pytest.mark.parametrize("fbgemm", BACKENDS)
def test_switch_decides_which_kernels_run(fbgemm):
    with ops.use_fbgemm(fbgemm), _RecordNamespaces() as record:
        _run_every_op()
    assert ("fbgemm" in record.namespaces) == fbgemm, record.namespaces


def test_unsupported_dtypes_take_the_torch_path():
    """fbgemm 1.8 has no kernel for these dtypes; recshard answers anyway, with torch."""
    with _RecordNamespaces() as record:
        same(
            ops.asynchronous_complete_cumsum(torch.tensor([1, 2], dtype=torch.int16)),
            [0, 1, 3],
            torch.int16,
        )
        same(
            ops.jagged_to_padded_dense(torch.tensor([True, False]), torch.tensor([0, 2]), 3),
            [[True, False, False]],
            torch.bool,
        )
        same(
            ops.segment_sum_csr(
                1, torch.tensor([0, 2]), torch.tensor([1.0, 2.0], dtype=torch.float64)
            ),
            [3.0],
            torch.float64,
        )
        out = ops.block_bucketize_sparse_features(
            torch.tensor([2]),
            torch.tensor([1, 6]),
            False,
            False,
            torch.tensor([5]),
            2,
            torch.tensor([1.0, 2.0]).half(),
        )
        same(out[2], [1.0, 2.0], torch.float16)
    assert "fbgemm" not in record.namespaces


def test_switch_restores_state_after_an_error():
    with pytest.raises(ValueError):
        with ops.use_fbgemm(False):
            ops.block_bucketize_sparse_features(
                torch.tensor([1]), torch.tensor([1]), False, False, torch.tensor([1]), 0
            )
    if ops.fbgemm_available():
        with _RecordNamespaces() as record:
            ops.asynchronous_complete_cumsum(torch.tensor([1, 2]))
        assert "fbgemm" in record.namespaces


def test_env_var_disables_fbgemm_in_a_fresh_process():
    script = textwrap.dedent("""
        import sys, torch, pytest
        from recshard.sparse import jagged_ops as ops
        assert not ops.fbgemm_available()
        assert "fbgemm_gpu" not in sys.modules  # never even imported
        with pytest.raises(RuntimeError, match="RECSHARD_DISABLE_FBGEMM"):
            with ops.use_fbgemm(True):
                pass
        out = ops.block_bucketize_sparse_features(
            torch.tensor([2, 1]), torch.tensor([0, 9, 4]), False, False, torch.tensor([5]), 2)
        assert out[0].tolist() == [1, 1, 1, 0] and out[1].tolist() == [0, 4, 4]
        print("ok")
    """)
    env = dict(os.environ, RECSHARD_DISABLE_FBGEMM="1")
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
