"""recshard.models.interaction: the C++ interaction kernels give the torch path's bytes (outputs
and both gradients) for any batch, feature count and dim, or stand aside for it (a probe that
fails, an inf or nan, a double backward)."""

from __future__ import annotations

import logging
from typing import Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recshard.models import interaction
from recshard.models.dlrm import InteractionArch
from recshard.models.interaction import pairwise_interaction, torch_interaction


def _positions(features: int) -> torch.Tensor:
    n = features + 1
    rows, cols = torch.triu_indices(n, n, offset=1, device="cpu")
    return rows * n + cols


def _inputs(batch: int, features: int, dim: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random vectors with what real batches hold: empty bags (zero vectors), all-negative
    vectors, and tiny ones whose products underflow to signed zeros."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, dim, generator=generator)
    sparse = torch.randn(batch, features, dim, generator=generator)
    if batch:
        sparse[:, seed % features] = 0.0
        sparse[0] = -sparse[0].abs()
        dense[-1] *= 1e-22
        sparse[-1] *= 1e-22
    return dense, sparse


def _run(path, dense, sparse, grad_out):  # type: ignore[no-untyped-def]
    dense = dense.clone().requires_grad_()
    sparse = sparse.clone().requires_grad_()
    out = path(dense, sparse, _positions(sparse.size(1)))
    grads = torch.autograd.grad(out, (dense, sparse), grad_out(out))
    return (out.detach(), *grads)


def _assert_same_bytes(got, expected) -> None:  # type: ignore[no-untyped-def]
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def _kernels_on(features: int, dim: int) -> bool:
    return interaction._kernels_apply(torch.empty(1, dim), torch.empty(1, features, dim))


def _kernels_run_here() -> bool:
    """The library is built and this CPU has AVX-512 (the kernels refuse finite inputs only
    without it): elsewhere every shape takes the torch path."""
    return interaction._forward(torch.ones(1, 1), torch.ones(1, 1, 1)) is not None


def _grad_with_zeros(seed: int):  # type: ignore[no-untyped-def]
    def make(out: torch.Tensor) -> torch.Tensor:
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
        grad[:, ::3] = 0.0
        if out.size(0):
            grad[0, 1::2] = -0.0
            grad[-1] *= 1e-25
        return grad

    return make


@settings(max_examples=60, deadline=None)
@given(
    batch=st.sampled_from([0, 1, 2, 3, 17, 64]),
    features=st.integers(1, 40),
    dim=st.sampled_from([1, 3, 8, 16, 24, 32, 64, 100, 128]),
    seed=st.integers(0, 2**16),
)
def test_same_bytes_as_the_torch_path(batch: int, features: int, dim: int, seed: int) -> None:
    dense, sparse = _inputs(batch, features, dim, seed)
    grad = _grad_with_zeros(seed)
    _assert_same_bytes(
        _run(pairwise_interaction, dense, sparse, grad),
        _run(torch_interaction, dense, sparse, grad),
    )


@pytest.mark.parametrize("seed", range(8))
def test_dlrm_shape_same_bytes_many_seeds(seed: int) -> None:
    """The benchmark's shape (26 features of dim 64, batch 2048 in the benchmark), where the
    kernels run on this machine: outputs, both gradients, and a gradient given as a strided
    slice or repeated rows (stride 0), as autograd may hand it over."""
    dense, sparse = _inputs(129, 26, 64, seed)
    for grad in (_grad_with_zeros(seed), lambda out: torch.ones(1, 1).expand(out.shape)):
        _assert_same_bytes(
            _run(pairwise_interaction, dense, sparse, grad),
            _run(torch_interaction, dense, sparse, grad),
        )
    wide = torch.randn(129, 2 * (64 + 351))[:, ::2]  # a strided gradient
    _assert_same_bytes(
        _run(pairwise_interaction, dense, sparse, lambda out: wide),
        _run(torch_interaction, dense, sparse, lambda out: wide),
    )


def test_kernels_run_for_dlrm_shapes_where_the_probe_passes() -> None:
    """On this machine (AVX-512, torch's MKL) the probe passes for DLRM's usual shapes; a
    machine where it does not falls back (the tests above still hold)."""
    if interaction._LIBRARY.load() is None:
        pytest.skip("the interaction library is not built")
    if not all(_kernels_on(26, dim) for dim in (16, 32, 64, 128)):
        pytest.skip("the kernels' bytes differ from torch.bmm's on this machine (probe off)")
    dense, sparse = _inputs(8, 26, 64, 0)
    out = interaction._forward(dense, sparse)
    assert out is not None
    assert torch.equal(out, torch_interaction(dense, sparse, _positions(26)))


def test_a_failing_probe_turns_the_kernels_off_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """4 features of dim 64: MKL sums these bmms in another order than the kernels' (on this
    machine; without AVX-512 the kernels refuse every shape), so the probe fails once, says
    why, and the torch path runs."""
    if interaction._LIBRARY.load() is None:
        pytest.skip("the interaction library is not built")
    key = (5, 64, torch.get_num_threads())
    interaction._matches.pop(key, None)
    with caplog.at_level(logging.INFO, logger="recshard.models.interaction"):
        on = _kernels_on(4, 64)
        _kernels_on(4, 64)
    if on:
        pytest.skip("MKL sums this shape in the kernels' order on this machine")
    why = "their bytes differ from torch.bmm's (MKL's order)"
    assert [r.getMessage() for r in caplog.records if "kernels off" in r.getMessage()] == [
        f"DLRM interaction kernels off for 4 sparse features of dim 64 at "
        f"{torch.get_num_threads()} threads: {why if _kernels_run_here() else 'no AVX-512'}; "
        "torch.bmm runs"
    ]
    dense, sparse = _inputs(16, 4, 64, 1)
    grad = _grad_with_zeros(1)
    _assert_same_bytes(
        _run(pairwise_interaction, dense, sparse, grad),
        _run(torch_interaction, dense, sparse, grad),
    )


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["dense", "sparse", "grad"])
def test_inf_and_nan_take_the_torch_path(bad: float, where: str) -> None:
    dense, sparse = _inputs(9, 26, 64, 3)
    if where == "dense":
        dense[4, 7] = bad
    elif where == "sparse":
        sparse[2, 5, 0] = bad

    def grad(out: torch.Tensor) -> torch.Tensor:
        g = _grad_with_zeros(3)(out)
        if where == "grad":
            g[5, 64 + 30] = bad
        return g

    _assert_same_bytes(
        _run(pairwise_interaction, dense, sparse, grad),
        _run(torch_interaction, dense, sparse, grad),
    )


def test_double_backward_matches_the_torch_path_to_rounding() -> None:
    """A double backward runs the torch path's backward with a graph, so second derivatives
    are right; their contributions add up in another order than the torch path's graph, so
    equal to rounding, not in bytes (the one documented exception)."""
    dense, sparse = _inputs(5, 26, 16, 4)

    def second(path):  # type: ignore[no-untyped-def]
        d, s = dense.clone().requires_grad_(), sparse.clone().requires_grad_()
        out = path(d, s, _positions(26))
        gd, gs = torch.autograd.grad(out.square().sum(), (d, s), create_graph=True)
        return torch.autograd.grad(gd.sum() + gs.square().sum(), (d, s))

    for got, expected in zip(second(pairwise_interaction), second(torch_interaction)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_only_one_input_needing_gradients() -> None:
    dense, sparse = _inputs(7, 26, 32, 5)
    sparse.requires_grad_()
    out = pairwise_interaction(dense, sparse, _positions(26))
    (got,) = torch.autograd.grad(out.sum(), (sparse,))
    sparse_ref = sparse.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(
        torch_interaction(dense, sparse_ref, _positions(26)).sum(), (sparse_ref,)
    )
    _assert_same_bytes((got,), (expected,))


def test_dlrm_interaction_traces_under_fx_with_the_kernels_as_a_leaf() -> None:
    graph = torch.fx.symbolic_trace(InteractionArch(26))
    assert any(node.target is pairwise_interaction for node in graph.graph.nodes)
    dense, sparse = _inputs(4, 26, 16, 6)
    assert torch.equal(graph(dense, sparse), torch_interaction(dense, sparse, _positions(26)))


def test_same_bytes_on_several_threads() -> None:
    """With torch's thread count above one the kernels split the batch into chunks (and torch's
    bmm threads too): bytes unchanged, probe run for that thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        dense, sparse = _inputs(301, 26, 64, 7)
        grad = _grad_with_zeros(7)
        _assert_same_bytes(
            _run(pairwise_interaction, dense, sparse, grad),
            _run(torch_interaction, dense, sparse, grad),
        )
        assert (27, 64, 3) in interaction._matches
    finally:
        torch.set_num_threads(threads)


def test_other_positions_take_the_torch_path() -> None:
    """The kernels write the row-major triangle; any other positions read by `gather` (here
    the triangle column by column) get the torch path's pairs in that order."""
    dense, sparse = _inputs(6, 26, 64, 8)
    n = 27
    rows, cols = torch.triu_indices(n, n, offset=1, device="cpu")
    by_column = (cols * n + rows)[torch.argsort(cols * n + rows)]
    got = pairwise_interaction(dense, sparse, by_column)
    _assert_same_bytes((got,), (torch_interaction(dense, sparse, by_column),))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_first_use_without_gradients(mode) -> None:  # type: ignore[no-untyped-def]
    """The probe needs gradients; a first call in evaluation (no_grad, inference_mode) still
    runs it and gives the torch path's bytes."""
    features, dim = 18, 48
    interaction._matches.pop((features + 1, dim, torch.get_num_threads()), None)
    dense, sparse = _inputs(5, features, dim, 9)
    with mode():
        got = pairwise_interaction(dense, sparse, _positions(features))
        expected = torch_interaction(dense, sparse, _positions(features))
    _assert_same_bytes((got,), (expected,))
    assert (features + 1, dim, torch.get_num_threads()) in interaction._matches


def test_autocast_takes_the_torch_path() -> None:
    """Under CPU autocast torch's bmm runs in bfloat16 (pairs rounded to it); the kernels
    (float32) stand aside."""
    dense, sparse = _inputs(5, 26, 64, 10)
    _kernels_on(26, 64)  # probed outside autocast: the kernels would run but for the check
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pairwise_interaction(dense, sparse, _positions(26))
        expected = torch_interaction(dense, sparse, _positions(26))
    assert not torch.equal(expected, torch_interaction(dense, sparse, _positions(26)))
    _assert_same_bytes((got,), (expected,))
