"""recshard's own CPU embedding-bag kernel (`csrc/cpu_tbe.cpp`), called through ctypes.

The C++ file is built by `pip install` (setup.py's extension `recshard.lookup._cpu_tbe`) and
opened here by path; it covers pooled SUM/MEAN lookups of fp32 tables of one dim held back to
back, forward and backward with the fused exact row-wise Adagrad update. `available()` says
whether the library loaded (a failed build or load logs one warning and callers fall back).

Tensors: `weights` `[total rows, D]` and `momentum` `[total rows]` fp32 contiguous; `row_start`
`[F]` int64 (feature f's first row); `indices` int32/int64 and `offsets` int32/int64
`[F * B + 1]` starting at 0, feature-major bags; `per_sample_weights` fp32 `[ids]` or None;
pooled output and its gradient `[B, F * D]` fp32.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)

_i64, _int, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_library: ctypes.CDLL | None = None
_load_tried = False


def _load() -> ctypes.CDLL | None:
    global _library, _load_tried
    if _load_tried:
        return _library
    _load_tried = True
    spec = importlib.util.find_spec("recshard.lookup._cpu_tbe")
    if spec is None or spec.origin is None:
        logger.warning(
            "recshard's CPU embedding kernel (recshard.lookup._cpu_tbe) is not built "
            "(reinstall with `pip install -e .`); using fbgemm's kernel instead"
        )
        return None
    try:
        library = ctypes.CDLL(spec.origin)
    except OSError as error:
        logger.warning("recshard's CPU embedding kernel failed to load (%s); using fbgemm", error)
        return None
    library.rs_tbe_forward.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _int, _ptr, _int]
    library.rs_tbe_forward.argtypes += [_ptr, _int, _ptr]
    library.rs_tbe_backward_rowwise_adagrad.argtypes = [
        *(_ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _int, _ptr, _int, _ptr, _int, _ptr),
        *(_f32, _f32, _ptr, ctypes.c_uint32),
    ]
    _library = library
    return library


def available() -> bool:
    """True when the compiled kernel loaded (warns once when it did not)."""
    return _load() is not None


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _width(tensor: torch.Tensor) -> int:
    if tensor.dtype not in (torch.int32, torch.int64) or not tensor.is_contiguous():
        raise ValueError(f"ids and offsets must be contiguous int32/int64, got {tensor.dtype}")
    return tensor.element_size()


def forward(
    weights: torch.Tensor,
    row_start: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    batch: int,
) -> torch.Tensor:
    """Pooled lookup of every feature: `[batch, F * D]`."""
    library = _load()
    assert library is not None, "native_tbe.available() first"
    features, dim = row_start.numel(), weights.size(1)
    out = torch.empty(batch, features * dim)
    code = library.rs_tbe_forward(
        weights.data_ptr(),
        dim,
        row_start.data_ptr(),
        features,
        batch,
        indices.data_ptr(),
        _width(indices),
        offsets.data_ptr(),
        _width(offsets),
        _address(per_sample_weights),
        int(mean),
        out.data_ptr(),
    )
    assert code == 0
    return out


def backward_rowwise_adagrad(
    weights: torch.Tensor,
    momentum: torch.Tensor,
    row_start: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    grad_output: torch.Tensor,
    lr: float,
    eps: float,
    per_sample_grad: bool,
) -> torch.Tensor | None:
    """Update `weights` and `momentum` in place from the pooled output's gradient; returns the
    per-sample weights' gradient `[ids]` when `per_sample_grad`, else None."""
    library = _load()
    assert library is not None, "native_tbe.available() first"
    grad_output = grad_output.contiguous()
    features, dim = row_start.numel(), weights.size(1)
    batch = grad_output.size(0)
    sample_grad = torch.empty(indices.numel()) if per_sample_grad else None
    code = library.rs_tbe_backward_rowwise_adagrad(
        weights.data_ptr(),
        momentum.data_ptr(),
        dim,
        row_start.data_ptr(),
        features,
        batch,
        indices.data_ptr(),
        _width(indices),
        offsets.data_ptr(),
        _width(offsets),
        _address(per_sample_weights),
        int(mean),
        grad_output.data_ptr(),
        lr,
        eps,
        _address(sample_grad),
        weights.size(0) - 1,
    )
    assert code == 0
    return sample_grad
