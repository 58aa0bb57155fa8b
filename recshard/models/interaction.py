"""DLRM's pairwise interaction, `[B, D]`, `[B, F, D]` -> `[B, D + F choose 2 + F]`: the dense
vector, then the upper triangle (no diagonal) of the `(F + 1) x (F + 1)` Gram matrix of the
dense and sparse vectors, row by row.

`torch_interaction` is the reference: `bmm` of the stacked vectors, the triangle read by
`gather` at its flat positions. `pairwise_interaction` gives the same bytes, forward and
backward, faster on CPU: the C++ kernels of `csrc/interaction.cpp` (setup.py's extension
`recshard.models._interaction`) compute only the triangle, keeping the summation order of the
MKL sgemm behind torch's `bmm` (one fused multiply-add chain per output), on torch's thread
count (chunks of the batch: samples are independent, so the bytes do not depend on it).

That order is MKL's choice, per CPU, build and shape, so the kernels are trusted for a shape
(`F + 1`, `D`, torch's thread count) only after a probe batch gave torch's bytes for the
outputs and both gradients; otherwise, and for other devices and dtypes, without AVX-512 or
the library, and for any batch with an inf or nan, the torch path runs. A double backward
(`create_graph=True`) runs the torch path's backward with its graph: right second
derivatives, equal to the torch path's to rounding only (their terms add up in another
order), the one exception to its bytes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Dict, Tuple

import torch

from recshard.lookup.native_library import NativeLibrary

logger = logging.getLogger(__name__)

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_OK = 0  # interaction.cpp's codes (1: an inf or nan, 2: no AVX-512, 3: no memory)


def _declare(library: ctypes.CDLL) -> None:
    library.ia_forward.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int]
    library.ia_forward.restype = _int
    library.ia_backward.argtypes = [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _int]
    library.ia_backward.restype = _int


_LIBRARY = NativeLibrary(
    "recshard.models._interaction",
    "DLRM interaction kernels",
    "DLRM's interaction runs torch.bmm instead (slower)",
    _declare,
    "csrc/interaction.cpp",
)

_matches: Dict[Tuple[int, int, int], bool] = {}  # (F + 1, D, threads) -> the probe's verdict
_PROBE_BATCH = 24  # the probe's least samples; smaller batches take the torch path


def _min_batch() -> int:
    """The probe's batch, and the least batch the kernels run for: at least two samples per
    thread, so that MKL hands whole products to threads as it did in the probe (with fewer
    samples than threads it splits one product across threads, in another order)."""
    return max(_PROBE_BATCH, 2 * torch.get_num_threads())


def torch_interaction(
    dense: torch.Tensor, sparse: torch.Tensor, triu_positions: torch.Tensor
) -> torch.Tensor:
    """The reference: `[B, D]`, `[B, F, D]`, flat triangle positions `[P]` -> `[B, D + P]`."""
    combined = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, F + 1, D]
    gram = torch.bmm(combined, combined.transpose(1, 2))  # [B, F + 1, F + 1]
    positions = triu_positions.expand(gram.size(0), -1)
    pairs = torch.gather(gram.flatten(1), 1, positions)  # [B, P]
    return torch.cat([dense, pairs], dim=1)


@torch.fx.wrap
def pairwise_interaction(
    dense: torch.Tensor, sparse: torch.Tensor, triu_positions: torch.Tensor
) -> torch.Tensor:
    """`torch_interaction`'s bytes, by the C++ kernels where they hold (a leaf in fx traces).

    The kernels write the pairs in row-major order of the triangle: they run only when
    `triu_positions` is that order (as `InteractionArch` builds it), and only for batches of
    at least the probe's size (`_min_batch`): MKL sums a smaller batch in another order at some
    thread counts (a batch of one at 3+ threads on a 2-core host: one gemm split across threads).
    """
    if (
        _kernels_apply(dense, sparse)
        and dense.size(0) >= _min_batch()
        and torch.equal(triu_positions, _row_major_triangle(sparse.size(1) + 1))
    ):
        return _KernelInteraction.apply(dense, sparse, triu_positions)
    return torch_interaction(dense, sparse, triu_positions)


@functools.cache
def _row_major_triangle(n: int) -> torch.Tensor:
    """Flat positions of the upper triangle (no diagonal) of `n x n`, row by row."""
    rows, cols = torch.triu_indices(n, n, offset=1, device="cpu")
    return rows * n + cols


def _kernels_apply(dense: torch.Tensor, sparse: torch.Tensor) -> bool:
    """CPU float32 `[B, D]` and `[B, F, D]` (no negation bit) outside autocast (which runs bmm
    in bf16), and the probe for this shape gave torch's bytes."""
    if dense.device.type != "cpu" or sparse.device.type != "cpu":
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    if dense.dtype != torch.float32 or sparse.dtype != torch.float32:
        return False
    if dense.is_neg() or sparse.is_neg():  # lazily negated views: memory holds -x
        return False
    if dense.dim() != 2 or sparse.dim() != 3 or sparse.size(0) != dense.size(0):
        return False
    if sparse.size(2) != dense.size(1) or sparse.size(1) == 0:
        return False
    key = (sparse.size(1) + 1, sparse.size(2), torch.get_num_threads())
    if key not in _matches:
        with torch.inference_mode(False), torch.enable_grad():  # the caller's mode may be either
            _matches[key] = _LIBRARY.load() is not None and _probe(key[0] - 1, key[1])
    return _matches[key]


def _forward(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor | None:
    """The kernel's output `[B, D + P]`, or None (no library or AVX-512, an inf or nan in it)."""
    batch, features, dim = sparse.shape
    n = features + 1
    library = _LIBRARY.load()
    if library is None:
        return None
    out = torch.empty(batch, dim + n * (n - 1) // 2, dtype=torch.float32, device="cpu")
    code = library.ia_forward(
        dense.data_ptr(),
        sparse.data_ptr(),
        out.data_ptr(),
        batch,
        features,
        dim,
        torch.get_num_threads(),
    )
    return out if code == _OK else None


def _backward(
    dense: torch.Tensor, sparse: torch.Tensor, grad_out: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's gradients of dense and sparse, or None (as `_forward`)."""
    batch, features, dim = sparse.shape
    grad_out = grad_out.resolve_neg()  # a lazily negated view's memory holds -grad
    if grad_out.stride(1) != 1:  # rows may be strided (a slice) or repeated (stride 0)
        grad_out = grad_out.contiguous()
    library = _LIBRARY.load()
    if library is None:
        return None
    grad_dense, grad_sparse = torch.empty_like(dense), torch.empty_like(sparse)
    code = library.ia_backward(
        dense.data_ptr(),
        sparse.data_ptr(),
        grad_out.data_ptr(),
        grad_out.stride(0),
        grad_dense.data_ptr(),
        grad_sparse.data_ptr(),
        batch,
        features,
        dim,
        torch.get_num_threads(),
    )
    return (grad_dense, grad_sparse) if code == _OK else None


def _torch_gradients(
    dense: torch.Tensor,
    sparse: torch.Tensor,
    triu_positions: torch.Tensor,
    grad_out: torch.Tensor,
    create_graph: bool,
) -> Tuple[torch.Tensor | None, torch.Tensor | None]:
    """The torch path's gradients; with `create_graph`, differentiable in dense and sparse."""
    if not create_graph:
        dense, sparse = dense.detach().requires_grad_(), sparse.detach().requires_grad_()
    inputs = [t for t in (dense, sparse) if t.requires_grad]
    with torch.enable_grad():
        out = torch_interaction(dense, sparse, triu_positions)
        grads = iter(torch.autograd.grad(out, inputs, grad_out, create_graph=create_graph))
    return tuple(next(grads) if t.requires_grad else None for t in (dense, sparse))  # type: ignore[return-value]


class _KernelInteraction(torch.autograd.Function):
    """`torch_interaction` with the kernels' forward and backward (the torch path where a
    kernel reports an inf or nan, and for a double backward)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        dense: torch.Tensor,
        sparse: torch.Tensor,
        triu_positions: torch.Tensor,
    ) -> torch.Tensor:
        dense, sparse = dense.contiguous(), sparse.contiguous()
        ctx.save_for_backward(dense, sparse, triu_positions)
        out = _forward(dense, sparse)
        return out if out is not None else torch_interaction(dense, sparse, triu_positions)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> Tuple[torch.Tensor | None, torch.Tensor | None, None]:
        dense, sparse, triu_positions = ctx.saved_tensors  # type: ignore[attr-defined]
        create_graph = torch.is_grad_enabled()
        grads = None if create_graph else _backward(dense, sparse, grad_out)
        if grads is None:
            grads = _torch_gradients(dense, sparse, triu_positions, grad_out, create_graph)
        return grads[0], grads[1], None


def _probe(features: int, dim: int) -> bool:
    """Whether the kernels give torch's bytes for `F = features`, `D = dim` on a probe batch
    (random vectors, tiny ones whose products underflow, zero and negative ones; gradients
    with zeros and tiny values); logs one line when they do not."""
    generator = torch.Generator().manual_seed(0)
    batch = _min_batch()
    dense = torch.randn(batch, dim, generator=generator, device="cpu")
    sparse = torch.randn(batch, features, dim, generator=generator, device="cpu")
    sparse[: batch // 3] *= 1e-22  # products near the smallest subnormal: signed zeros
    dense[: batch // 3] *= 1e-22
    sparse[batch // 3, :] = 0.0  # empty bags
    sparse[:, features // 2] = -sparse[:, features // 2].abs()
    positions = _row_major_triangle(features + 1)
    grad_out = torch.randn(batch, dim + positions.numel(), generator=generator, device="cpu")
    grad_out[:, ::3] = 0.0
    grad_out[-batch // 3 :] *= 1e-25
    dense.requires_grad_()
    sparse.requires_grad_()
    reference = torch_interaction(dense, sparse, positions)
    expected = (reference.detach(), *torch.autograd.grad(reference, (dense, sparse), grad_out))
    dense, sparse = dense.detach(), sparse.detach()
    out = _forward(dense, sparse)
    grads = _backward(dense, sparse, grad_out)
    got = None if out is None or grads is None else (out, *grads)
    if got is not None and all(_same_bytes(a, b) for a, b in zip(got, expected)):
        return True
    logger.info(
        "DLRM interaction kernels off for %d sparse features of dim %d at %d threads: %s; "
        "torch.bmm runs",
        features,
        dim,
        torch.get_num_threads(),
        "no AVX-512" if got is None else "their bytes differ from torch.bmm's (MKL's order)",
    )
    return False


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
