"""KeyedTensor: dense per-key blocks side by side, `[B, sum(dims)]` — the pooled EBC output."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from recshard.sparse.traceable import TraceableConstruction


def offsets_from_sizes(sizes: Sequence[int]) -> List[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


class KeyedTensor(metaclass=TraceableConstruction):
    """`values` holds one block per key along `key_dim`; key k spans
    `offset_per_key[k] : offset_per_key[k] + length_per_key[k]`. Built from symbolic values in
    a torch.fx trace, it becomes one graph node (as TorchRec's)."""

    def __init__(
        self,
        keys: List[str],
        length_per_key: List[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: List[int] | None = None,
        index_per_key: Dict[str, int] | None = None,
    ) -> None:
        if len(keys) != len(length_per_key):
            raise ValueError(f"{len(keys)} keys but {len(length_per_key)} lengths")
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate keys in KeyedTensor: {keys}")
        total = sum(length_per_key)
        if keys and (values.dim() <= key_dim or values.size(key_dim) != total):
            raise ValueError(
                f"KeyedTensor values of shape {tuple(values.shape)} do not have {total} "
                f"(= sum of length_per_key {length_per_key}) entries along dim {key_dim}"
            )
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key = offset_per_key
        self._index_per_key = index_per_key

    @staticmethod
    def from_tensor_list(
        keys: List[str], tensors: List[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        lengths = [t.size(key_dim) for t in tensors]
        return KeyedTensor(keys, lengths, torch.cat(tensors, dim=cat_dim), key_dim)

    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> List[int]:
        return self._length_per_key

    def offset_per_key(self) -> List[int]:
        if self._offset_per_key is None:
            self._offset_per_key = offsets_from_sizes(self._length_per_key)
        return self._offset_per_key

    def _index(self) -> Dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def __getitem__(self, key: str) -> torch.Tensor:
        index = self._index().get(key)
        if index is None:
            raise KeyError(f"KeyedTensor has no key '{key}' (keys: {self._keys})")
        start = self.offset_per_key()[index]
        return self._values.narrow(self._key_dim, start, self._length_per_key[index])

    def to_dict(self) -> Dict[str, torch.Tensor]:
        blocks = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        return dict(zip(self._keys, blocks))

    @staticmethod
    def regroup(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
        """One tensor per group, its keys' blocks side by side in the group's order."""
        return regroup_kts(keyed_tensors, groups)

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: List[KeyedTensor], groups: List[List[str]], keys: List[str]
    ) -> Dict[str, torch.Tensor]:
        if len(groups) != len(keys):
            raise ValueError(f"{len(groups)} groups but {len(keys)} names")
        tensors = KeyedTensor.regroup(keyed_tensors, groups)  # indexed: a proxy when traced
        return {key: tensors[i] for i, key in enumerate(keys)}

    def to(self, device: torch.device, non_blocking: bool = False) -> KeyedTensor:
        return KeyedTensor(
            self._keys,
            self._length_per_key,
            self._values.to(device, non_blocking=non_blocking),
            self._key_dim,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        if self._values.is_cuda:
            self._values.record_stream(stream)

    def __str__(self) -> str:
        """TorchRec's form: one entry per key, the rows of its block."""
        if not self._keys:
            return "KeyedTensor()\n"
        entries = [f'    "{key}": {self[key].tolist()}' for key in self._keys]
        return "KeyedTensor({\n" + ",\n".join(entries) + "\n})\n"

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, "
            f"values={self._values})"
        )


@torch.fx.wrap
def regroup_kts(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """One tensor per group, its keys' blocks side by side in the group's order; a key may
    be in several groups or in none. A leaf in torch.fx traces, as TorchRec's.

    All blocks are gathered with one `index_select` over the concatenated values, so the
    backward is one scatter, whatever the number of keys.
    """
    key_dim = keyed_tensors[0].key_dim()
    columns: Dict[str, torch.Tensor] = {}
    base = 0
    for kt in keyed_tensors:
        for key, offset, length in zip(kt.keys(), kt.offset_per_key(), kt.length_per_key()):
            if key in columns:
                raise ValueError(f"key '{key}' appears in more than one KeyedTensor")
            columns[key] = torch.arange(base + offset, base + offset + length, device="cpu")
        base += kt.offset_per_key()[-1]
    missing = [k for g in groups for k in g if k not in columns]
    if missing:
        raise KeyError(f"regroup: keys {missing} are in no KeyedTensor")
    values = torch.cat([kt.values() for kt in keyed_tensors], dim=key_dim)
    out = []
    for group in groups:  # each index built on the host, then moved once
        index = (
            torch.cat([columns[k] for k in group])
            if group
            else torch.empty(0, dtype=torch.long, device="cpu")
        )
        out.append(values.index_select(key_dim, index.to(values.device)))
    return out


# TorchRec's fbgemm-backed variant of the same regrouping; one implementation serves both.
permute_multi_embedding = regroup_kts
torch.fx.wrap("permute_multi_embedding")
