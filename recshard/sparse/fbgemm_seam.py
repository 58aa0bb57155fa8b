"""The fbgemm/torch switch every jagged kernel goes through, and the checks they share.

`fbgemm_op(name, device, supported)` gives fbgemm's op when fbgemm imports, is enabled and has
a kernel for the device (its tensor arguments made contiguous), else None and the caller runs
its torch path. `recshard.sparse.jagged_ops` and `recshard.sparse.bucketize` build on it.

Switches: `RECSHARD_DISABLE_FBGEMM=1` (read once, at first use; fbgemm is then never
imported) and the `use_fbgemm(False)` context manager (process-wide, all threads).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

__all__ = [
    "DISABLE_ENV_VAR",
    "INDEX_DTYPES",
    "check_1d",
    "check_permute",
    "complete_cumsum",
    "fbgemm_available",
    "fbgemm_op",
    "needs_grad",
    "segment_ranges",
    "use_fbgemm",
]

logger = logging.getLogger(__name__)

DISABLE_ENV_VAR = "RECSHARD_DISABLE_FBGEMM"
INDEX_DTYPES = (torch.int32, torch.int64)  # fbgemm's index dtypes
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


def fbgemm_op(name: str, device: torch.device, supported: bool = True) -> Callable[..., Any] | None:
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


def complete_cumsum(lengths: Tensor) -> Tensor:
    """Torch `[N] -> [N+1]` int64 offsets (internal index math)."""
    return torch.cat(
        [lengths.new_zeros(1, dtype=torch.long), torch.cumsum(lengths, 0, dtype=torch.long)]
    )


def segment_ranges(starts: Tensor, seg_lengths: Tensor, total: int | None = None) -> Tensor:
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


def needs_grad(*tensors: Tensor | None) -> bool:
    """True when autograd must flow into one of `tensors`."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_permute(permute: Tensor, size: int, what: str) -> None:
    """Range-check a permute on CPU (fbgemm reads out of bounds on bad input; no sync cost)."""
    if permute.dim() != 1:
        raise ValueError(f"{what}: permute must be 1-D, got shape {tuple(permute.shape)}")
    if permute.device.type == "cpu" and permute.numel():
        low, high = int(permute.min()), int(permute.max())
        if low < 0 or high >= size:
            bad = low if low < 0 else high
            raise ValueError(f"{what}: permute index {bad} out of range for {size} segments")


def check_1d(what: str, **tensors: Tensor | None) -> None:
    """Raise naming `what` and the argument when one of `tensors` is not 1-D."""
    for name, t in tensors.items():
        if t is not None and t.dim() != 1:
            raise ValueError(f"{what}: {name} must be 1-D, got shape {tuple(t.shape)}")


def check_jagged(what: str, name: str, bounds: Tensor, num_values: int, offsets: bool) -> None:
    """Refuse lengths or offsets that reach outside `num_values` values, on CPU.

    fbgemm's ops read (and write) past the end on them: garbage results or a corrupted heap.
    `offsets`: `bounds` are offsets (non-decreasing from >= 0), else lengths (>= 0). The
    checks cost one pass over `bounds`; CUDA inputs are trusted as fbgemm does (no sync).
    """
    if bounds.device.type != "cpu" or bounds.numel() == 0:
        return
    flat = bounds.reshape(-1).long()
    if offsets:
        if int(flat[0]) < 0 or bool((flat.diff() < 0).any()):
            raise ValueError(f"{what}: {name} must be non-decreasing from >= 0, got {_show(flat)}")
        end = int(flat[-1])
    else:
        low = int(flat.min())
        if low < 0:
            raise ValueError(f"{what}: {name} holds a negative length {low}")
        end = int(flat.sum())
    if end > num_values:
        raise ValueError(f"{what}: {name} reach {end} values, past the {num_values} given")


def check_values(what: str, lengths: Tensor, values: Tensor, weights: Tensor | None) -> None:
    """Refuse lengths past `values` and weights of another size (fbgemm reads past the end)."""
    check_jagged(what, "lengths", lengths, values.numel(), False)
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(
            f"{what}: weights has {weights.numel()} entries, not one per value ({values.numel()})"
        )


def _show(values: Tensor, limit: int = 12) -> str:
    """A short printable form of a 1-D tensor for an error message."""
    items = values[:limit].tolist()
    return str(items)[:-1] + (", ...]" if values.numel() > limit else "]")
