"""Consistency checks for user-built KeyedJaggedTensors, with messages naming key and numbers.

Run at user-facing construction (skippable with `validate=False` on hot paths): a wrong
length here would otherwise surface as garbage embeddings or a hang inside a collective.
"""

from __future__ import annotations

from typing import List, Optional, Protocol

import torch


class KeyedJaggedLike(Protocol):
    """What the checks read of a KeyedJaggedTensor (a protocol, so this module sits below
    `keyed_jagged_tensor.py`, which calls it, instead of importing it back)."""

    def keys(self) -> List[str]: ...
    def values(self) -> torch.Tensor: ...
    def weights_or_none(self) -> Optional[torch.Tensor]: ...
    def lengths_or_none(self) -> Optional[torch.Tensor]: ...
    def offsets_or_none(self) -> Optional[torch.Tensor]: ...
    def stride(self) -> int: ...
    def stride_per_key(self) -> List[int]: ...
    def lengths_offset_per_key(self) -> List[int]: ...


def _key_at(kjt: KeyedJaggedLike, position: int) -> str:
    """The key that owns entry `position` of `lengths`."""
    bounds = kjt.lengths_offset_per_key()
    for index, end in enumerate(bounds[1:]):
        if position < end:
            return kjt.keys()[index]
    return "<past the last key>"


def validate_kjt(kjt: KeyedJaggedLike) -> None:
    """Raise ValueError if keys, lengths, offsets, values and weights disagree."""
    keys: List[str] = kjt.keys()
    seen = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"KeyedJaggedTensor: duplicate key '{key}' in {keys}")
        seen.add(key)
    values = kjt.values()
    if values.dim() != 1:
        raise ValueError(f"KeyedJaggedTensor: values must be 1-D, got shape {tuple(values.shape)}")
    expected_entries = sum(kjt.stride_per_key())
    offsets = kjt.offsets_or_none()
    lengths = kjt.lengths_or_none()
    if offsets is not None:
        if offsets.numel() != expected_entries + 1:
            raise ValueError(
                f"KeyedJaggedTensor: offsets has {offsets.numel()} entries, expected "
                f"{expected_entries + 1} ({len(keys)} keys x batch {kjt.stride()} + 1)"
            )
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
        if lengths.numel() != expected_entries:
            raise ValueError(
                f"KeyedJaggedTensor: lengths has {lengths.numel()} entries, expected "
                f"{expected_entries} ({len(keys)} keys, batch sizes per key {kjt.stride_per_key()})"
            )
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
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(
            f"KeyedJaggedTensor: weights has {weights.numel()} entries but values has "
            f"{values.numel()}"
        )
