"""Register the sparse types as pytree nodes so torch utilities (tree_map, export, DDP input
scanning) see through them to their tensors."""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch.fx._pytree import register_pytree_flatten_spec
from torch.utils import _pytree as pytree

from recshard.sparse.jagged_tensor import JaggedTensor
from recshard.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from recshard.sparse.keyed_tensor import KeyedTensor, permute_multi_embedding

Children = List[torch.Tensor | None]


def _present(tensors: Children) -> Tuple[List[torch.Tensor], Tuple[bool, ...]]:
    """Only real tensors become leaves (so tree_map functions never see None)."""
    return [t for t in tensors if t is not None], tuple(t is not None for t in tensors)


def _restore(leaves: List[torch.Tensor], present: Tuple[bool, ...]) -> Children:
    it = iter(leaves)
    return [next(it) if p else None for p in present]


def _kjt_flatten(kjt: KeyedJaggedTensor) -> Tuple[List[torch.Tensor], Any]:
    inverse = kjt.inverse_indices_or_none()
    leaves, present = _present(
        [
            kjt.values(),
            kjt.weights_or_none(),
            kjt.lengths_or_none(),
            kjt.offsets_or_none(),
            None if inverse is None else inverse[1],
        ]
    )
    spkpr = kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None
    inverse_keys = None if inverse is None else inverse[0]
    return leaves, (kjt.keys(), kjt.stride(), spkpr, inverse_keys, present)


def _kjt_unflatten(leaves: List[torch.Tensor], context: Any) -> KeyedJaggedTensor:
    keys, stride, spkpr, inverse_keys, present = context
    values, weights, lengths, offsets, inverse = _restore(leaves, present)
    return KeyedJaggedTensor(
        keys,
        values,
        weights,
        lengths=lengths,
        offsets=offsets,
        stride=stride,
        stride_per_key_per_rank=spkpr,
        inverse_indices=None if inverse is None else (inverse_keys, inverse),
        validate=False,
    )


def _jt_flatten(jt: JaggedTensor) -> Tuple[List[torch.Tensor], Any]:
    return _present([jt.values(), jt.weights_or_none(), jt.lengths_or_none(), jt.offsets_or_none()])


def _jt_unflatten(leaves: List[torch.Tensor], present: Any) -> JaggedTensor:
    values, weights, lengths, offsets = _restore(leaves, present)
    return JaggedTensor(values, weights, lengths, offsets)


def _kt_flatten(kt: KeyedTensor) -> Tuple[Children, Any]:
    return [kt.values()], (kt.keys(), kt.length_per_key(), kt.key_dim())


def _kt_unflatten(children: Children, context: Any) -> KeyedTensor:
    keys, length_per_key, key_dim = context
    return KeyedTensor(keys, length_per_key, children[0], key_dim)


_FIELDS = ("values", "weights", "lengths", "offsets", "inverse_indices")
KeyedLeaves = List[Tuple[pytree.KeyEntry, torch.Tensor]]


def _named(leaves: List[torch.Tensor], present: Tuple[bool, ...]) -> KeyedLeaves:
    """Leaves keyed by the accessor they came from (torch.export needs paths to its inputs)."""
    names = [name for name, here in zip(_FIELDS, present) if here]
    return [(pytree.GetAttrKey(name), leaf) for name, leaf in zip(names, leaves)]


def _kjt_flatten_with_keys(kjt: KeyedJaggedTensor) -> Tuple[KeyedLeaves, Any]:
    leaves, context = _kjt_flatten(kjt)
    return _named(leaves, context[-1]), context


def _jt_flatten_with_keys(jt: JaggedTensor) -> Tuple[KeyedLeaves, Any]:
    leaves, present = _jt_flatten(jt)
    return _named(leaves, present), present


def _kt_flatten_with_keys(kt: KeyedTensor) -> Tuple[KeyedLeaves, Any]:
    children, context = _kt_flatten(kt)
    return [(pytree.GetAttrKey("values"), children[0])], context


def _kt_flatten_spec(kt: KeyedTensor, spec: pytree.TreeSpec) -> List[torch.Tensor]:
    """The leaves `spec` expects: values with the spec's keys in the spec's order (an
    exported program's KeyedTensor may come back with its keys in another order)."""
    keys = spec.context[0]
    if kt.keys() == keys:
        return [kt.values()]
    return [permute_multi_embedding([kt], [keys])[0]]


def _jt_flatten_spec(jt: JaggedTensor, spec: pytree.TreeSpec) -> List[torch.Tensor]:
    return _jt_flatten(jt)[0]


def _kjt_flatten_spec(kjt: KeyedJaggedTensor, spec: pytree.TreeSpec) -> List[torch.Tensor]:
    return _kjt_flatten(kjt)[0]


def register() -> None:
    """Pytree nodes (torch.utils._pytree) and their fx flatten specs (torch.fx._pytree's
    `tree_flatten_spec`, what exported and traced programs flatten their inputs with)."""
    for cls, flatten, unflatten, with_keys, flatten_spec in (
        (
            KeyedJaggedTensor,
            _kjt_flatten,
            _kjt_unflatten,
            _kjt_flatten_with_keys,
            _kjt_flatten_spec,
        ),
        (JaggedTensor, _jt_flatten, _jt_unflatten, _jt_flatten_with_keys, _jt_flatten_spec),
        (KeyedTensor, _kt_flatten, _kt_unflatten, _kt_flatten_with_keys, _kt_flatten_spec),
    ):
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_pytree_node(
                cls,
                flatten,
                unflatten,
                serialized_type_name=f"recshard.{cls.__name__}",
                flatten_with_keys_fn=with_keys,
            )
            register_pytree_flatten_spec(cls, flatten_spec)
