"""recshard.models.interaction under attack: thread counts above the cores, batches at and
under the probe's, odd strides and offsets, several Python threads at once. Every case
must give the torch path's bytes (outputs and both gradients) or raise torch's own error."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recshard.models import interaction
from recshard.models.interaction import pairwise_interaction, torch_interaction
from tests.models.test_interaction import (
    _assert_same_bytes,
    _grad_with_zeros,
    _inputs,
    _kernels_on,
    _kernels_run_here,
    _positions,
    _run,
)


@settings(max_examples=40, deadline=None)
@given(
    threads=st.sampled_from([1, 2, 3, 4, 8]),
    batch=st.sampled_from([0, 1, 2, 3, 5, 23, 24, 25, 64, 129]),
    features=st.sampled_from([1, 2, 13, 26, 40, 64]),
    dim=st.sampled_from([1, 5, 16, 17, 33, 64, 128]),
    seed=st.integers(0, 2**16),
)
def test_same_bytes_at_any_thread_count_and_batch(
    threads: int, batch: int, features: int, dim: int, seed: int
) -> None:
    """Torch's bmm sums a batch of one in another order at 3+ threads on a 2-core host (MKL
    splits the single gemm); the kernels must not run where the probe did not show them."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(seed)
        dense = torch.randn(batch, dim, generator=generator)
        sparse = torch.randn(batch, features, dim, generator=generator)
        grad = _grad_with_zeros(seed)
        _assert_same_bytes(
            _run(pairwise_interaction, dense, sparse, grad),
            _run(torch_interaction, dense, sparse, grad),
        )
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [3, 4, 8])
def test_batch_of_one_on_more_threads_than_cores(threads: int) -> None:
    """The case found: batch 1, 26 features of dim 128, 3+ threads (forward and the sparse
    gradient differed from torch.bmm's while the probe at batch 24 passed)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for features, dim in ((26, 128), (13, 17), (64, 16)):
            generator = torch.Generator().manual_seed(features)
            dense = torch.randn(1, dim, generator=generator)
            sparse = torch.randn(1, features, dim, generator=generator)
            grad = _grad_with_zeros(3)
            _assert_same_bytes(
                _run(pairwise_interaction, dense, sparse, grad),
                _run(torch_interaction, dense, sparse, grad),
            )
    finally:
        torch.set_num_threads(saved)


def _layouts(dense: torch.Tensor, sparse: torch.Tensor) -> List[tuple]:
    """The same values as strided, offset, transposed and repeated (stride 0) tensors."""
    batch, features, dim = sparse.shape
    offset_dense = torch.empty(batch * dim + 3)[3:].view(batch, dim)
    offset_dense.copy_(dense)
    offset_sparse = torch.empty(sparse.numel() + 1)[1:].view(sparse.shape)  # 4-byte misaligned
    offset_sparse.copy_(sparse)
    wide_sparse = torch.empty(batch, features, 2 * dim)[:, :, ::2]
    wide_sparse.copy_(sparse)
    transposed = sparse.transpose(1, 2).contiguous().transpose(1, 2)
    repeated = (dense[:1].expand(batch, dim), sparse[:1].expand(batch, features, dim))
    return [
        (offset_dense, offset_sparse),
        (dense, wide_sparse),
        (dense.t().contiguous().t(), transposed),
        repeated,
    ]


@pytest.mark.parametrize("batch", [24, 65])
def test_strided_offset_and_repeated_inputs(batch: int) -> None:
    for features, dim in ((26, 64), (13, 17)):
        dense, sparse = _inputs(batch, features, dim, 5)
        for d, s in _layouts(dense, sparse):
            grad = _grad_with_zeros(5)
            _assert_same_bytes(
                _run(pairwise_interaction, d, s, grad), _run(torch_interaction, d, s, grad)
            )


def test_wrong_shapes_dtypes_and_devices_take_torch_errors() -> None:
    """Mismatched batch, dim, dtype or device never reach the kernels: torch's error or
    torch's bytes."""
    dense, sparse = _inputs(30, 26, 64, 1)
    positions = _positions(26)
    with pytest.raises(RuntimeError):
        pairwise_interaction(dense[:29], sparse, positions)
    with pytest.raises(RuntimeError):
        pairwise_interaction(dense[:, :63], sparse, positions)
    for d, s in ((dense.double(), sparse), (dense.double(), sparse.double())):
        assert torch.equal(
            pairwise_interaction(d, s, positions), torch_interaction(d, s, positions)
        )
    with pytest.raises(RuntimeError):
        pairwise_interaction(dense, sparse.to("meta"), positions)


def test_a_gradient_of_the_wrong_shape_is_refused_by_autograd() -> None:
    dense, sparse = _inputs(30, 26, 64, 2)
    dense.requires_grad_()
    out = pairwise_interaction(dense, sparse, _positions(26))
    with pytest.raises(RuntimeError, match="shape"):
        torch.autograd.grad(out, dense, torch.ones(30, out.size(1) - 1))


def test_several_python_threads_at_once() -> None:
    """Four Python threads call forward and backward together (ctypes drops the GIL): each
    gets the torch path's bytes."""
    dense, sparse = _inputs(200, 26, 64, 4)
    grad = _grad_with_zeros(4)
    expected = _run(torch_interaction, dense, sparse, grad)
    failures: List[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                _assert_same_bytes(_run(pairwise_interaction, dense, sparse, grad), expected)
        except BaseException as error:  # noqa: BLE001 - reported on the main thread
            failures.append(error)

    workers = [threading.Thread(target=work) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures


def test_negative_bit_views_are_read_as_their_values() -> None:
    """A tensor with torch's lazy negation bit (`torch._neg_view`: its memory holds -x) as
    dense, sparse or the output's gradient: the torch path's bytes, not those of its memory."""
    dense, sparse = _inputs(64, 26, 64, 11)
    grad = _grad_with_zeros(11)
    for d, s, g in (
        (torch._neg_view(dense), sparse, grad),
        (dense, torch._neg_view(sparse), grad),
        (dense, sparse, lambda out: torch._neg_view(grad(out))),
    ):
        _assert_same_bytes(_run(pairwise_interaction, d, s, g), _run(torch_interaction, d, s, g))


# F + 1 rows at the backward's block edges (4k + 1..4k + 3, 8k, 16k + 1 rows; blocks of 4, 5, 8
# and 16 rows) and D not a multiple of 16 (1, 2, 3 and 4 vectors of 16 lanes, a 64-column tail)
EDGE_FEATURES = [1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 17, 18, 19, 20, 23, 24, 31, 32, 33]
EDGE_DIMS = [1, 7, 15, 17, 31, 33, 47, 49, 63, 65, 79, 100, 129]


@pytest.mark.parametrize("threads", [1, 2])
def test_block_edges_same_bytes(threads: int) -> None:
    """Every (F, D) above at batch 24 and 150 (two chunks at 2 threads), contiguous and as a
    4-byte misaligned / strided copy: torch's bytes; the kernels must run for most shapes
    where the probe passes (else the comparison tests nothing)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    ran = 0
    try:
        for features in EDGE_FEATURES:
            for dim in EDGE_DIMS:
                ran += _kernels_on(features, dim)
                for batch in (24, 150):
                    dense, sparse = _inputs(batch, features, dim, features * 1000 + dim)
                    grad = _grad_with_zeros(dim)
                    expected = _run(torch_interaction, dense, sparse, grad)
                    for d, s in [(dense, sparse), _layouts(dense, sparse)[0]]:
                        got = _run(pairwise_interaction, d, s, grad)
                        try:
                            _assert_same_bytes(got, expected)
                        except AssertionError:
                            raise AssertionError(f"F {features} D {dim} batch {batch}") from None
    finally:
        torch.set_num_threads(saved)
    if _kernels_run_here():
        assert ran > 0, "the probe turned the kernels off for every shape"


NO_MEMORY = """
import resource, torch
from recshard.models import interaction

library = interaction._LIBRARY.load()
batch, features, dim = 2, 26, 200_000  # the forward's scratch: dim x 64 floats, 51 MB
dense, sparse = torch.ones(batch, dim), torch.ones(batch, features, dim)
out = torch.empty(batch, dim + 27 * 26 // 2)
status = open("/proc/self/status").read()
used = int(status.split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + (8 << 20), resource.RLIM_INFINITY))
code = library.ia_forward(
    dense.data_ptr(), sparse.data_ptr(), out.data_ptr(), batch, features, dim, 1
)
print("code", code)
"""


def test_no_memory_for_the_scratch_is_a_code_not_an_abort() -> None:
    """The address space held to 8 MiB past what the process uses: the forward's per-chunk
    scratch cannot be allocated; the kernel says so (the torch path runs), the process lives."""
    if interaction._LIBRARY.load() is None:
        pytest.skip("the interaction library is not built")
    result = subprocess.run(
        [sys.executable, "-c", NO_MEMORY],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("code 3", "code 2"), result.stdout  # 2: no AVX-512
