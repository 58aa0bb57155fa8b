"""`KTRegroupAsDict`: KeyedTensors regrouped into named tensors, as a module (TorchRec's).

    regroup = KTRegroupAsDict(groups=[["f1", "f2"], ["f3"]], keys=["user", "object"])
    out = regroup([ebc_output, dense_kt])  # {"user": [B, D_f1 + D_f2], "object": [B, D_f3]}

Each output is its group's key blocks side by side along the key dim (a key may be in several
groups or in none), by `KeyedTensor.regroup_as_dict`, the one regroup implementation (a leaf
under torch.fx). It reads the inputs' layout every batch: nothing is cached, so inputs whose
layout changes between batches regroup correctly and `clear_cache()` has nothing to clear.
`emb_dtype` casts the outputs (TorchRec casts the inputs: the same values).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from recshard.modules.embedding_configs import DATA_TYPE_TO_DTYPE, DataType
from recshard.sparse import KeyedTensor


class KTRegroupAsDict(nn.Module):
    """`groups[i]`: the input keys of output `keys[i]`. `multi_device` is accepted for
    TorchRec's signature (the gather index follows the values' device anyway)."""

    def __init__(
        self,
        groups: List[List[str]],
        keys: List[str],
        emb_dtype: DataType | None = None,
        multi_device: bool = False,
    ) -> None:
        super().__init__()
        if len(groups) != len(keys):
            raise ValueError(f"KTRegroupAsDict: {len(groups)} groups but {len(keys)} keys ({keys})")
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"KTRegroupAsDict: output keys {repeated} appear more than once")
        if emb_dtype is not None and emb_dtype not in DATA_TYPE_TO_DTYPE:
            raise ValueError(
                f"KTRegroupAsDict: emb_dtype {emb_dtype} is not one of "
                f"{[d.value for d in DATA_TYPE_TO_DTYPE]}"
            )
        self._groups = [list(g) for g in groups]
        self._keys = list(keys)
        self._dtype = None if emb_dtype is None else DATA_TYPE_TO_DTYPE[emb_dtype]

    def forward(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        """`{keys[i]: [B, sum of groups[i]'s key lengths]}` (key dim 1; along dim 0
        for key dim 0)."""
        if all(isinstance(kt, KeyedTensor) for kt in keyed_tensors):  # not Proxies (torch.fx)
            _check_inputs(keyed_tensors)
        out = KeyedTensor.regroup_as_dict(keyed_tensors, self._groups, self._keys)
        if self._dtype is None:
            return out
        return {key: tensor.to(self._dtype) for key, tensor in out.items()}

    def clear_cache(self) -> None:
        """TorchRec's: forget the cached layout. Nothing is cached here (see the module doc)."""


def _check_inputs(keyed_tensors: List[KeyedTensor]) -> None:
    """At least one KeyedTensor; all on one device with one key dim."""
    if not keyed_tensors:
        raise ValueError("KTRegroupAsDict: no KeyedTensors given")
    first = keyed_tensors[0]
    for index, kt in enumerate(keyed_tensors):
        if kt.key_dim() != first.key_dim():
            raise ValueError(
                f"KTRegroupAsDict: KeyedTensor {index} (keys {kt.keys()}) has key dim "
                f"{kt.key_dim()}, KeyedTensor 0 has {first.key_dim()}"
            )
        if kt.device() != first.device():
            raise ValueError(
                f"KTRegroupAsDict: KeyedTensor {index} (keys {kt.keys()}) is on "
                f"{kt.device()}, KeyedTensor 0 on {first.device()}"
            )
