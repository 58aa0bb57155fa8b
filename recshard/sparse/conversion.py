"""ComputeKJTToJTDict / ComputeJTDictToKJT: TorchRec's conversions as modules, so a model
can hold them (and a tracer sees one call instead of per-key Python)."""

from __future__ import annotations

from typing import Dict, List

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


def jagged_by_index(features: KeyedJaggedTensor) -> List[JaggedTensor]:
    """One JaggedTensor per key position (keys may repeat: column shards of one table)."""
    values, weights, lengths = features.values(), features.weights_or_none(), features.lengths()
    offsets, lengths_offsets = features.offset_per_key(), features.lengths_offset_per_key()
    return [
        JaggedTensor(
            values[offsets[i] : offsets[i + 1]],
            None if weights is None else weights[offsets[i] : offsets[i + 1]],
            lengths=lengths.reshape(-1)[lengths_offsets[i] : lengths_offsets[i + 1]],
        )
        for i in range(len(features.keys()))
    ]
