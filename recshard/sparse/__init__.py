"""Sparse data types: JaggedTensor, KeyedJaggedTensor (ids per feature) and KeyedTensor."""

from recshard.sparse.jagged_tensor import JaggedTensor
from recshard.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from recshard.sparse.keyed_tensor import KeyedTensor
from recshard.sparse.pytree import register as _register_pytree

_register_pytree()

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
