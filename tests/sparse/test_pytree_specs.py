"""The sparse types as TorchRec 1.8 treats them where only structure or shapes exist: fx
flatten specs (torch.fx._pytree.tree_flatten_spec, what exported and traced programs flatten
their inputs with; a KeyedTensor whose keys come in another order is flattened in the spec's
key order), and a KeyedJaggedTensor on `meta`."""

from __future__ import annotations

import torch
from torch.fx._pytree import tree_flatten_spec
from torch.utils import _pytree as pytree

from recshard import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def test_keyed_tensor_spec_puts_keys_in_the_spec_order() -> None:
    kt = KeyedTensor.from_tensor_list(
        ["dense_0", "dense_1"],
        [torch.tensor([[1.0], [1.0]]), torch.tensor([[2.0, 3.0], [2.0, 3.0]])],
    )
    leaves, spec = pytree.tree_flatten(kt)
    assert torch.equal(leaves[0], kt.values())
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, KeyedTensor) and rebuilt.keys() == kt.keys()
    assert rebuilt.length_per_key() == [1, 2]
    swapped = KeyedTensor.from_tensor_list(
        ["dense_1", "dense_0"],
        [torch.tensor([[2.0, 3.0], [2.0, 3.0]]), torch.tensor([[1.0], [1.0]])],
    )
    again = pytree.tree_unflatten(tree_flatten_spec(swapped, spec), spec)
    assert again.keys() == ["dense_0", "dense_1"]
    for key in kt.keys():
        torch.testing.assert_close(again[key], kt[key])


def test_jagged_and_keyed_jagged_specs_give_the_leaves() -> None:
    jt = JaggedTensor(torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([2, 1]))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1, 0])
    )
    for value in (jt, kjt, {"x": kjt, "y": [jt]}):
        leaves, spec = pytree.tree_flatten(value)
        got = tree_flatten_spec(value, spec)
        assert len(got) == len(leaves) and all(torch.equal(a, b) for a, b in zip(got, leaves))


def test_kjt_on_meta_splits_values_evenly_as_torchrec() -> None:
    """No data on `meta`: TorchRec 1.8 gives each key values.numel() // keys ids, the rest to
    the first key (its to_dict, split and offset_per_key then work for shape inference)."""
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.empty(3, dtype=torch.long, device="meta"),
        lengths=torch.empty(4, dtype=torch.int32, device="meta"),
    )
    assert kjt.length_per_key() == [2, 1] and kjt.offset_per_key() == [0, 2, 3]
    jts = kjt.to_dict()
    assert jts["a"].values().shape == (2,) and jts["b"].values().shape == (1,)
    assert jts["a"].lengths().shape == (2,) and jts["a"].values().is_meta
