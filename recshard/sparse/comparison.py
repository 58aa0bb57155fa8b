"""jt_is_equal / kjt_is_equal: TorchRec's structural equality of sparse tensors.

Two tensors are equal when their values, weights, lengths and offsets match (floats with
`torch.allclose`); an optional field (weights) must be present in both or absent in both.
"""

from __future__ import annotations

from typing import List

import torch

from recshard.sparse.jagged_tensor import JaggedTensor
from recshard.sparse.keyed_jagged_tensor import KeyedJaggedTensor

Field = torch.Tensor | List[int] | int | None


def _same(a: Field, b: Field) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.allclose(a, b.to(a.dtype)))
    return a == b


def _fields(x: JaggedTensor | KeyedJaggedTensor) -> List[torch.Tensor | None]:
    # lengths and offsets derive from each other: compare both, whichever was given
    return [x.weights_or_none(), x.lengths(), x.offsets()]


def jt_is_equal(jt_1: JaggedTensor, jt_2: JaggedTensor) -> bool:
    """True if both are JaggedTensors holding the same rows (values, weights, lengths)."""
    if not isinstance(jt_1, JaggedTensor) or not isinstance(jt_2, JaggedTensor):
        return False
    if not _same(jt_1.values(), jt_2.values()):
        return False
    return all(_same(a, b) for a, b in zip(_fields(jt_1), _fields(jt_2)))


def kjt_is_equal(kjt_1: KeyedJaggedTensor, kjt_2: KeyedJaggedTensor) -> bool:
    """True if both are KeyedJaggedTensors with the same keys (in order), values, weights,
    lengths, per-key sums and batch size."""
    if not isinstance(kjt_1, KeyedJaggedTensor) or not isinstance(kjt_2, KeyedJaggedTensor):
        return False
    if kjt_1.keys() != kjt_2.keys() or not _same(kjt_1.values(), kjt_2.values()):
        return False
    if not all(_same(a, b) for a, b in zip(_fields(kjt_1), _fields(kjt_2))):
        return False
    return kjt_1.length_per_key() == kjt_2.length_per_key() and kjt_1.stride() == kjt_2.stride()
