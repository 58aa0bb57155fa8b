"""recshard's own CPU embedding-bag kernel (`csrc/cpu_tbe.cpp`), called through ctypes.

The C++ file is built by `pip install` (setup.py's extension `recshard.lookup._cpu_tbe`) and
opened here by path; it covers pooled SUM/MEAN lookups of fp32 tables held back to back in
one buffer, forward and backward with a fused exact update: row-wise Adagrad or SGD. `available()`
says whether the library loaded (a missing build or a failed load logs one warning; callers
then use fbgemm's kernel or the pure-torch one).

Tensors: `weights` fp32, every table's `[rows, dim]` back to back (`TableLayout`),
`momentum` fp32 `[all rows]` (row-wise Adagrad only); `indices` int32/int64 and `offsets`
int32/int64 `[F * B + 1]` from 0, bags feature-major; `per_sample_weights` fp32 `[ids]` or
None; the pooled output and its gradient `[B, sum of the features' dims]` fp32.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import List

import torch

from recshard.lookup.native_library import NativeLibrary

_i64, _int, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
MAX_POSITIONS = 2**31  # the C++ side keys ids' positions and rows as uint32
MAX_GRAD_FLOATS = 2**32  # ... and where each bag's output-gradient row starts


def _declare(library: ctypes.CDLL) -> None:
    layout = [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64]  # TableLayout, B, width
    ids = [_ptr, _int, _ptr, _int, _ptr, _int]  # indices, offsets, per-sample weights, mean
    library.rs_tbe_forward.argtypes = [_ptr, *layout, *ids, _ptr]
    library.rs_tbe_forward.restype = _i64
    library.rs_tbe_backward_rowwise_adagrad.argtypes = [
        *(_ptr, _ptr, *layout, *ids, _ptr, _f32, _f32, _ptr)
    ]
    library.rs_tbe_backward_rowwise_adagrad.restype = _i64
    library.rs_tbe_backward_sgd.argtypes = [_ptr, *layout, *ids, _ptr, _f32, _ptr]
    library.rs_tbe_backward_sgd.restype = _i64


_LIBRARY = NativeLibrary(
    "recshard.lookup._cpu_tbe",
    "CPU embedding kernel",
    "fp32 row-wise Adagrad and SGD tables run fbgemm's kernel (or the torch one) instead",
    _declare,
    "csrc/cpu_tbe.cpp",
)


def available() -> bool:
    """True when the compiled kernel loaded (warns once when it did not)."""
    return _LIBRARY.load() is not None


@dataclass(frozen=True)
class TableLayout:
    """Where each table's rows sit in the weights buffer and each feature's columns in the
    output: int64 tensors the C++ side reads (`cpu_tbe.cpp`'s `Layout`)."""

    row_start: torch.Tensor  # [T + 1]: table t's first global row; all rows last
    weight_start: torch.Tensor  # [T]: table t's first float in the weights buffer
    table_dim: torch.Tensor  # [T]
    feature_table: torch.Tensor  # [F]
    feature_column: torch.Tensor  # [F]: feature f's first output column
    width: int  # output columns
    floats: int  # the weights buffer's length

    @staticmethod
    def of(rows: List[int], dims: List[int], feature_table: List[int]) -> TableLayout:
        row_start = [0]
        weight_start = [0]
        for n, dim in zip(rows, dims):
            row_start.append(row_start[-1] + n)
            weight_start.append(weight_start[-1] + n * dim)
        columns = [0]
        for t in feature_table:
            columns.append(columns[-1] + dims[t])
        return TableLayout(
            row_start=torch.tensor(row_start, dtype=torch.int64, device="cpu"),
            weight_start=torch.tensor(weight_start[:-1], dtype=torch.int64, device="cpu"),
            table_dim=torch.tensor(dims, dtype=torch.int64, device="cpu"),
            feature_table=torch.tensor(feature_table, dtype=torch.int64, device="cpu"),
            feature_column=torch.tensor(columns[:-1], dtype=torch.int64, device="cpu"),
            width=columns[-1],
            floats=weight_start[-1],
        )

    @property
    def total_rows(self) -> int:
        return int(self.row_start[-1])

    def args(self, batch: int) -> list:
        return [
            self.row_start.data_ptr(),
            self.weight_start.data_ptr(),
            self.table_dim.data_ptr(),
            self.table_dim.numel(),
            self.feature_table.data_ptr(),
            self.feature_column.data_ptr(),
            self.feature_table.numel(),
            batch,
            self.width,
        ]


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _width(tensor: torch.Tensor) -> int:
    if tensor.dtype not in (torch.int32, torch.int64) or not tensor.is_contiguous():
        raise ValueError(f"ids and offsets must be contiguous int32/int64, got {tensor.dtype}")
    return tensor.element_size()


class IdOutOfRange(ValueError):
    """An id outside its table's rows reached the kernel (bounds check mode NONE): nothing
    was read or written out of bounds. `position` is the id's index in `indices`."""

    def __init__(self, position: int) -> None:
        super().__init__(f"id at position {position} is outside its table's rows")
        self.position = position


class OffsetsDecrease(ValueError):
    """Bag offsets that go down (bag `bag` ends before it starts): nothing was read or
    written. `bag` counts feature-major (feature `bag // B`)."""

    def __init__(self, bag: int, offsets: torch.Tensor) -> None:
        super().__init__(
            f"offsets must not decrease: bag {bag} runs from {int(offsets[bag])} "
            f"to {int(offsets[bag + 1])}"
        )
        self.bag = bag


def _check(code: int) -> None:
    if code >= 0:
        raise IdOutOfRange(code)
    if code != -1:  # not an assert: `python -O` would hand back an uninitialized output
        raise RuntimeError(f"cpu_tbe: bad call ({code})")


def _check_buffers(
    weights: torch.Tensor,
    layout: TableLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch: int,
) -> None:
    """Refuse buffers the C++ side would read or write past: it trusts every pointer and length
    it is given (two passes over `offsets`, O(1) for the rest)."""
    for name, tensor in (("weights", weights), ("indices", indices), ("offsets", offsets)):
        _on_cpu(name, tensor)  # a CUDA pointer read on the host faults
    if per_sample_weights is not None:
        _on_cpu("per_sample_weights", per_sample_weights)
    _float_buffer("weights", weights, layout.floats)
    if per_sample_weights is not None:
        _float_buffer("per_sample_weights", per_sample_weights, indices.numel())
    bags = layout.feature_table.numel() * batch
    if offsets.dim() != 1 or offsets.numel() != bags + 1:
        raise ValueError(f"offsets: {bags + 1} entries needed, got shape {tuple(offsets.shape)}")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.numel() >= MAX_POSITIONS or batch * layout.width > MAX_GRAD_FLOATS:
        raise ValueError(
            f"{indices.numel()} ids or a [{batch}, {layout.width}] output gradient exceed the "
            "C++ kernel's 32-bit positions"
        )
    low, high = (int(v) for v in torch.aminmax(offsets))
    if low < 0 or high > indices.numel() or int(offsets[0]) != 0:
        raise ValueError(
            f"offsets must start at 0 and stay within the {indices.numel()} ids, "
            f"got values in [{low}, {high}]"
        )
    # a bag reaching back before its predecessor would read ids outside its feature's range,
    # which the C++ side checks against that feature's table only (and sizes its scratch by
    # the last offset): out-of-bounds reads and writes
    if offsets.numel() > 1:
        steps = offsets.diff()
        if int(steps.min()) < 0:
            raise OffsetsDecrease(int(torch.nonzero(steps < 0)[0]), offsets)


def _on_cpu(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{name} must be on the CPU for recshard's C++ kernel, got {tensor.device}"
        )


def _float_buffer(name: str, tensor: torch.Tensor, numel: int) -> None:
    if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.numel() != numel:
        raise ValueError(
            f"{name}: a contiguous float32 buffer of {numel} values needed, got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}"
        )


def _ids_args(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
) -> list:
    return [
        indices.data_ptr(),
        _width(indices),
        offsets.data_ptr(),
        _width(offsets),
        _address(per_sample_weights),
        int(mean),
    ]


def forward(
    weights: torch.Tensor,
    layout: TableLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    batch: int,
) -> torch.Tensor:
    """Pooled lookup of every feature: `[batch, layout.width]`. Raises `IdOutOfRange` for an id
    outside its table."""
    library = _LIBRARY.load()
    assert library is not None, "native_tbe.available() first"
    _check_buffers(weights, layout, indices, offsets, per_sample_weights, batch)
    out = torch.empty(batch, layout.width, device="cpu")
    code = library.rs_tbe_forward(
        weights.data_ptr(),
        *layout.args(batch),
        *_ids_args(indices, offsets, per_sample_weights, mean),
        out.data_ptr(),
    )
    _check(code)
    return out


def backward(
    weights: torch.Tensor,
    momentum: torch.Tensor | None,
    layout: TableLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    grad_output: torch.Tensor,
    lr: float,
    eps: float,
    per_sample_grad: bool,
) -> torch.Tensor | None:
    """Update `weights` (and `momentum`) in place from the pooled output's gradient: exact
    row-wise Adagrad with `momentum`, exact SGD without it (`eps` unused). Returns the
    per-sample weights' gradient `[ids]` when `per_sample_grad`, else None. Raises
    `IdOutOfRange` (before any update) for an id outside its table."""
    library = _LIBRARY.load()
    assert library is not None, "native_tbe.available() first"
    grad_output = grad_output.contiguous()
    batch = grad_output.size(0)
    _check_buffers(weights, layout, indices, offsets, per_sample_weights, batch)
    _on_cpu("grad_output", grad_output)
    _float_buffer("grad_output", grad_output, batch * layout.width)
    if momentum is not None:
        _on_cpu("momentum", momentum)
        _float_buffer("momentum", momentum, layout.total_rows)
    sample_grad = torch.empty(indices.numel(), device="cpu") if per_sample_grad else None
    common = [
        *layout.args(batch),
        *_ids_args(indices, offsets, per_sample_weights, mean),
        grad_output.data_ptr(),
        lr,
    ]
    if momentum is None:
        code = library.rs_tbe_backward_sgd(weights.data_ptr(), *common, _address(sample_grad))
    else:
        code = library.rs_tbe_backward_rowwise_adagrad(
            weights.data_ptr(), momentum.data_ptr(), *common, eps, _address(sample_grad)
        )
    _check(code)
    return sample_grad
