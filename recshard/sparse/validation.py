"""Consistency checks for KeyedJaggedTensors, with messages naming key and numbers.

Two levels, as TorchRec's constructor accepts more than a module can consume:
`check_structure` (O(keys), no host sync) runs at construction; `validate_kjt` (every
check, reads lengths/offsets on the host) runs where the data is consumed — the sharded
modules before any collective, the unsharded ones when a cheap check fails — and from
`KeyedJaggedTensor.validate()`. A wrong length would otherwise surface as garbage
embeddings or a hang inside a collective. `validate_keyed_jagged_tensor` is TorchRec's
entry point: every check, then (given table configs) ids out of their table's rows reported
as a warning and a False result.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Protocol, Sequence

import torch

from recshard.sparse.jagged_tensor import check_index_dtype

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1


class KeyedJaggedLike(Protocol):
    """What the checks read of a KeyedJaggedTensor (a protocol, so this module sits below
    `keyed_jagged_tensor.py`, which calls it, instead of importing it back)."""

    def keys(self) -> List[str]: ...
    def values(self) -> torch.Tensor: ...
    def weights_or_none(self) -> torch.Tensor | None: ...
    def lengths_or_none(self) -> torch.Tensor | None: ...
    def offsets_or_none(self) -> torch.Tensor | None: ...
    def stride(self) -> int: ...
    def stride_per_key(self) -> List[int]: ...
    def lengths_offset_per_key(self) -> List[int]: ...
    def length_per_key(self) -> List[int]: ...


class TableLike(Protocol):
    """What the id-range check reads of an embedding table config (`EmbeddingBagConfig`)."""

    num_embeddings: int
    feature_names: List[str]


def _key_at(kjt: KeyedJaggedLike, position: int) -> str:
    """The key that owns entry `position` of `lengths`."""
    bounds = kjt.lengths_offset_per_key()
    for index, end in enumerate(bounds[1:]):
        if position < end:
            return kjt.keys()[index]
    return "<past the last key>"


def _check_offsets_match_lengths(
    kjt: KeyedJaggedLike, steps: torch.Tensor, lengths: torch.Tensor
) -> None:
    """Given both, offsets must be the running sum of lengths (`steps` = their differences):
    ops read either one, so a disagreement would give rows that depend on the op."""
    differ = steps != lengths
    if bool(differ.any()):
        position = int(torch.nonzero(differ)[0])
        key = _key_at(kjt, position)
        batch_pos = position - kjt.lengths_offset_per_key()[kjt.keys().index(key)]
        raise ValueError(
            f"KeyedJaggedTensor: offsets are not the running sum of lengths: key '{key}' at "
            f"batch position {batch_pos} has length {int(lengths[position])} but offsets step "
            f"{int(steps[position])}"
        )


def check_structure(kjt: KeyedJaggedLike) -> None:
    """Unique keys, integer lengths/offsets, and as many of them as keys x batch sizes.

    O(keys) and no host sync; an empty `offsets` (or `lengths`) is an empty batch."""
    keys: List[str] = kjt.keys()
    if len(set(keys)) != len(keys):
        duplicate = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise ValueError(f"KeyedJaggedTensor: duplicate key '{duplicate}' in {keys}")
    expected_entries = sum(kjt.stride_per_key())
    offsets = kjt.offsets_or_none()
    lengths = kjt.lengths_or_none()
    check_index_dtype(offsets, "offsets", "KeyedJaggedTensor")
    check_index_dtype(lengths, "lengths", "KeyedJaggedTensor")
    if (
        offsets is not None
        and offsets.numel() != expected_entries + 1
        and (offsets.numel() or expected_entries)
    ):
        raise ValueError(
            f"KeyedJaggedTensor: offsets has {offsets.numel()} entries, expected "
            f"{expected_entries + 1} ({len(keys)} keys x batch {kjt.stride()} + 1)"
        )
    if lengths is not None and lengths.numel() != expected_entries:
        raise ValueError(
            f"KeyedJaggedTensor: lengths has {lengths.numel()} entries, expected "
            f"{expected_entries} ({len(keys)} keys, batch sizes per key {kjt.stride_per_key()})"
        )


def int32_lengths_wrap(kjt: KeyedJaggedLike) -> bool:
    """True when int32 lengths sum past 2**31 - 1 (from the per-key sums: no temporary)."""
    lengths = kjt.lengths_or_none()
    return (
        lengths is not None
        and lengths.dtype == torch.int32
        and sum(kjt.length_per_key()) > INT32_MAX
    )


def check_int32_lengths(kjt: KeyedJaggedLike) -> None:
    """int32 lengths whose sum passes 2**31 - 1: their offsets, a running sum in the lengths'
    dtype, wrap to negative numbers, which would surface later as "offsets decrease" or a
    lengths/values mismatch. Refused naming the key where the running sum passes."""
    if not int32_lengths_wrap(kjt):
        return
    per_key = kjt.length_per_key()
    running = 0
    for key, count in zip(kjt.keys(), per_key):
        running += count
        if running > INT32_MAX:
            raise ValueError(
                f"KeyedJaggedTensor: int32 lengths sum to {sum(per_key)}, past 2**31 - 1 = "
                f"{INT32_MAX} at key '{key}' (running sum {running}): their int32 offsets "
                "would wrap; pass int64 lengths"
            )


def validate_kjt(kjt: KeyedJaggedLike) -> None:
    """Raise ValueError if keys, lengths, offsets, values and weights disagree (values must
    be 1-D ids, exactly as many as the lengths sum to; weights 1-D, one per id; int32
    lengths sum within int32)."""
    check_structure(kjt)
    check_int32_lengths(kjt)
    keys: List[str] = kjt.keys()
    values = kjt.values()
    if values.dim() != 1:
        raise ValueError(f"KeyedJaggedTensor: values must be 1-D, got shape {tuple(values.shape)}")
    offsets = kjt.offsets_or_none()
    lengths = kjt.lengths_or_none()
    total = 0
    if offsets is not None:
        if offsets.numel() and int(offsets[0]) != 0:
            raise ValueError(f"KeyedJaggedTensor: offsets must start at 0, got {int(offsets[0])}")
        steps = offsets[1:] - offsets[:-1]
        if steps.numel() and bool((steps < 0).any()):
            position = int(torch.nonzero(steps < 0)[0])
            raise ValueError(
                f"KeyedJaggedTensor: offsets decrease at entry {position + 1} "
                f"(key '{_key_at(kjt, position)}'): {int(offsets[position])} -> "
                f"{int(offsets[position + 1])}"
            )
        total = int(offsets[-1]) if offsets.numel() else 0
    if lengths is not None:
        if lengths.numel() and bool((lengths < 0).any()):
            position = int(torch.nonzero(lengths < 0)[0])
            stride_start = kjt.lengths_offset_per_key()
            key = _key_at(kjt, position)
            batch_pos = position - stride_start[keys.index(key)]
            raise ValueError(
                f"KeyedJaggedTensor: key '{key}' has negative length {int(lengths[position])} "
                f"at batch position {batch_pos}"
            )
        total = int(lengths.sum()) if lengths.numel() else 0
        if offsets is not None and offsets.numel() and total != int(offsets[-1]):
            raise ValueError(
                f"KeyedJaggedTensor: lengths sum to {total} but offsets end at {int(offsets[-1])}"
            )
        if offsets is not None and offsets.numel():
            _check_offsets_match_lengths(kjt, offsets[1:] - offsets[:-1], lengths)
    if total != values.numel():
        per_key = ""
        if lengths is not None and keys:
            sums = [int(s.sum()) for s in torch.split(lengths, kjt.stride_per_key())]
            per_key = " (per key: " + ", ".join(f"{k}={s}" for k, s in zip(keys, sums)) + ")"
        raise ValueError(
            f"KeyedJaggedTensor: lengths sum to {total}{per_key} but values has "
            f"{values.numel()} entries"
        )
    weights = kjt.weights_or_none()
    if weights is not None and weights.dim() != 1:
        raise ValueError(
            f"KeyedJaggedTensor: weights must be 1-D (one per id), got shape {tuple(weights.shape)}"
        )
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(
            f"KeyedJaggedTensor: weights has {weights.numel()} entries but values has "
            f"{values.numel()}"
        )


def validate_keyed_jagged_tensor(
    kjt: KeyedJaggedLike, configs: Sequence[TableLike] | None = None
) -> bool:
    """TorchRec's validator: a ValueError if the KJT is inconsistent (`validate_kjt`); given
    `configs`, False (and a warning naming feature and ids) if some feature's ids fall outside
    `[0, num_embeddings)` of its table, else True."""
    validate_kjt(kjt)
    if configs is None:
        return True
    rows: Dict[str, int] = {f: c.num_embeddings for c in configs for f in c.feature_names}
    valid = True
    ids_per_key = torch.split(kjt.values(), kjt.length_per_key())
    for key, ids in zip(kjt.keys(), ids_per_key):
        if key not in rows or ids.numel() == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= rows[key]:
            logger.warning(
                "feature '%s' has ids in [%d, %d], outside its table's [0, %d)",
                key,
                low,
                high,
                rows[key],
            )
            valid = False
    return valid
