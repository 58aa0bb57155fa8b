"""Stage 1 of the KJT all-to-all: what a rank tells every other about its batch before any id
moves, one int64 row per destination (`kjt.py` sends them).

Row r says, for the keys going to rank r, their batch sizes and id counts (per key), this
rank's batch size, the dtypes of lengths / values / weights, the range of its lengths, and the
validity verdict (a flag plus the first line of the error message, `verdict.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from recshard.sparse import KeyedJaggedTensor

_DTYPES = [
    torch.int32,
    torch.int64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int16,
    torch.int8,
    torch.uint8,
]
# Fixed columns of a metadata row: rejected flag, variable-batch flag, stride, 3 dtype codes,
# the smallest and largest of the sender's lengths.
(
    REJECTED,
    VBE,
    STRIDE,
    LENGTHS_DTYPE,
    VALUES_DTYPE,
    WEIGHTS_DTYPE,
    LENGTHS_MIN,
    LENGTHS_MAX,
) = range(8)
FIXED = 8  # then the per-key batch sizes, the per-key id counts, the message (`verdict.py`)
_LABELS = ("lengths", "values", "weights")


def dtype_code(t: torch.Tensor | None) -> int:
    """1 + the index of `t`'s dtype in the supported list; 0 for no tensor, -1 unsupported."""
    return 0 if t is None else _DTYPES.index(t.dtype) + 1 if t.dtype in _DTYPES else -1


def _dtype_name(code: int) -> str:
    return "none" if code == 0 else str(_DTYPES[code - 1]).replace("torch.", "")


@dataclass
class Selected:
    """The keys this rank sends, in wire order: `kjt.permute(key_order)` without moving the
    ids (the pack reads each key's ids where they are; only the lengths are permuted)."""

    keys: List[str]
    strides: List[int]
    counts: List[int]
    starts: List[int]  # where each key's ids begin in `kjt.values()`
    lengths: torch.Tensor


def select_keys(kjt: KeyedJaggedTensor, key_order: List[int] | None) -> Selected:
    """`kjt`'s keys as sent; `key_order` (indices, repeats allowed) needs one batch size."""
    starts = kjt.offset_per_key()[:-1]
    if key_order is None:
        return Selected(
            kjt.keys(), kjt.stride_per_key(), kjt.length_per_key(), starts, kjt.lengths()
        )
    keys, counts = kjt.keys(), kjt.length_per_key()
    order = torch.tensor(key_order, dtype=torch.int64, device=kjt.lengths().device)
    lengths = kjt.lengths().view(len(keys), -1).index_select(0, order).view(-1)
    return Selected(
        [keys[i] for i in key_order],
        [kjt.stride()] * len(key_order),
        [counts[i] for i in key_order],
        [starts[i] for i in key_order],
        lengths,
    )


def check_input(
    kjt: KeyedJaggedTensor, splits: List[int], key_order: List[int] | None
) -> str | None:
    """What is wrong with this rank's input, or None."""
    keys = kjt.keys() if key_order is None else [kjt.keys()[i] for i in key_order]
    if sum(splits) != len(keys):
        return (
            f"KJTAllToAll: splits {splits} sum to {sum(splits)} keys but the "
            f"KeyedJaggedTensor has {len(keys)}: {keys}"
        )
    if kjt.values().is_floating_point() or kjt.lengths().is_floating_point():
        return (
            f"KJTAllToAll: ids and lengths must be integers, got values "
            f"{kjt.values().dtype} and lengths {kjt.lengths().dtype}"
        )
    weights = kjt.weights_or_none()
    if weights is not None and not weights.is_floating_point():
        return f"KJTAllToAll: weights must be floating point, got {weights.dtype}"
    for name, t in (("lengths", kjt.lengths()), ("values", kjt.values()), ("weights", weights)):
        if t is not None and dtype_code(t) < 0:
            return f"KJTAllToAll: unsupported {name} dtype {t.dtype}"
    return None


def fill_metadata(
    sent: torch.Tensor, kjt: KeyedJaggedTensor, selected: Selected, splits: List[int]
) -> None:
    """Metadata rows `sent [W, width]`, one per destination: the keys `splits[r]` of
    `selected` rank r receives, their batch sizes and id counts, and what holds for all."""
    strides, counts = selected.strides, selected.counts
    bounds = [sum(splits[:r]) for r in range(len(splits) + 1)]
    lengths, weights = selected.lengths, kjt.weights_or_none()
    sent[:, VBE] = int(kjt.variable_stride_per_key())
    sent[:, STRIDE] = kjt.stride()
    sent[:, LENGTHS_DTYPE] = dtype_code(lengths)
    sent[:, VALUES_DTYPE] = dtype_code(kjt.values())
    sent[:, WEIGHTS_DTYPE] = dtype_code(weights)
    if lengths.numel():
        low, high = torch.aminmax(lengths)
        sent[:, LENGTHS_MIN], sent[:, LENGTHS_MAX] = int(low), int(high)
    for r, num in enumerate(splits):
        lo, hi = bounds[r], bounds[r + 1]
        sent[r, FIXED : FIXED + num] = torch.tensor(
            strides[lo:hi], dtype=torch.int64, device=sent.device
        )
        sent[r, FIXED + num : FIXED + 2 * num] = torch.tensor(
            counts[lo:hi], dtype=torch.int64, device=sent.device
        )


def check_dtypes_agree(received: torch.Tensor) -> None:
    """Every rank's lengths / values / weights dtypes (rows of `received`) are the same."""
    for column, label in zip((LENGTHS_DTYPE, VALUES_DTYPE, WEIGHTS_DTYPE), _LABELS):
        codes = received[:, column].tolist()
        if len(set(codes)) > 1:
            per_rank = ", ".join(f"rank {r} {_dtype_name(c)}" for r, c in enumerate(codes))
            raise ValueError(f"KJTAllToAll: ranks disagree on the {label} dtype: {per_rank}")
