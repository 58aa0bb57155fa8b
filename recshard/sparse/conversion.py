"""ComputeKJTToJTDict / ComputeJTDictToKJT: TorchRec's conversions as modules, so a model
can hold them (and a tracer sees one call instead of per-key Python)."""

from __future__ import annotations

from typing import Dict

from torch import nn

from recshard.sparse.jagged_tensor import JaggedTensor
from recshard.sparse.keyed_jagged_tensor import KeyedJaggedTensor


class ComputeKJTToJTDict(nn.Module):
    """`{key: JaggedTensor}` of a KeyedJaggedTensor, in key order (views of its storage)."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        return keyed_jagged_tensor.to_dict()


class ComputeJTDictToKJT(nn.Module):
    """A KeyedJaggedTensor of `{key: JaggedTensor}` (different batch sizes: variable batch)."""

    def forward(self, jt_dict: Dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)
