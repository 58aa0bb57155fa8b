"""How the jagged types print: TorchRec's `str` forms (rows of values, and of weights when
present) and recshard's one-line `repr` of a KeyedJaggedTensor."""

from __future__ import annotations

from typing import Dict, List, Protocol

import torch


class Jagged(Protocol):
    """What printing reads of a JaggedTensor (typed structurally: the types import this)."""

    def values(self) -> torch.Tensor: ...

    def weights_or_none(self) -> torch.Tensor | None: ...

    def offsets(self) -> torch.Tensor: ...

    def to_dense(self) -> List[torch.Tensor]: ...


class KeyedJagged(Jagged, Protocol):
    """What printing reads of a KeyedJaggedTensor."""

    def keys(self) -> List[str]: ...

    def stride(self) -> int: ...

    def lengths_offset_per_key(self) -> List[int]: ...

    def to_dict(self) -> Dict[str, Jagged]: ...


def values_string(values: torch.Tensor, offsets: List[int]) -> str:
    """`[[v, ...], [...]]`, one inner list per row (TorchRec's printed form)."""
    if values.dim() > 2:
        raise ValueError("values with more than 2 dimensions cannot be printed")
    rows = [values[start:end].tolist() for start, end in zip(offsets[:-1], offsets[1:])]
    return str(rows)


def jt_string(jt: Jagged) -> str:
    """TorchRec's form: rows of values (and of weights when present)."""
    offsets = jt.offsets().tolist()
    weights = jt.weights_or_none()
    if weights is None:
        return "JaggedTensor({\n    " + values_string(jt.values(), offsets) + "\n})\n"
    return (
        'JaggedTensor({\n    "values": '
        + values_string(jt.values(), offsets)
        + ',\n    "weights": '
        + values_string(weights, offsets)
        + "\n})\n"
    )


def kjt_string(kjt: KeyedJagged) -> str:
    """TorchRec's form: one entry per key, rows of values (and weights when present)."""
    if not kjt.keys():
        return "KeyedJaggedTensor()\n"
    if kjt.values().is_meta:
        return kjt_repr(kjt) + "\n"
    values, weights = kjt.values(), kjt.weights_or_none()
    offsets = kjt.offsets().tolist()
    bounds = kjt.lengths_offset_per_key()
    entries = []
    for index, key in enumerate(kjt.keys()):
        rows = offsets[bounds[index] : bounds[index + 1] + 1]
        if weights is None:
            entries.append(f'    "{key}": ' + values_string(values, rows))
        else:
            entries.append(
                f'    "{key}": {{\n        "values": '
                + values_string(values, rows)
                + ',\n        "weights": '
                + values_string(weights, rows)
                + "\n    }"
            )
    return "KeyedJaggedTensor({\n" + ",\n".join(entries) + "\n})\n"


def kjt_repr(kjt: KeyedJagged) -> str:
    """`KeyedJaggedTensor({'key': [[ids of bag 0], ...], ...}[, weighted])`; on `meta` (no data
    to show: shape inference) the keys and the batch size."""
    if not kjt.keys():
        return "KeyedJaggedTensor()"
    if kjt.values().is_meta:
        return f"KeyedJaggedTensor(keys={kjt.keys()}, stride={kjt.stride()}, device='meta')"
    parts = []
    for key, jt in kjt.to_dict().items():
        rows = [r.tolist() for r in jt.to_dense()]
        parts.append(f"'{key}': {rows}")
    weighted = ", weighted" if kjt.weights_or_none() is not None else ""
    return "KeyedJaggedTensor({" + ", ".join(parts) + "}" + weighted + ")"
