"""Sparse data types: JaggedTensor, KeyedJaggedTensor (ids per feature) and KeyedTensor."""

from recshard.sparse.comparison import jt_is_equal, kjt_is_equal
from recshard.sparse.conversion import ComputeJTDictToKJT, ComputeKJTToJTDict
from recshard.sparse.jagged_tensor import JaggedTensor
from recshard.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from recshard.sparse.keyed_tensor import KeyedTensor, permute_multi_embedding, regroup_kts
from recshard.sparse.pytree import register as _register_pytree

_register_pytree()

__all__ = [
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "jt_is_equal",
    "kjt_is_equal",
    "permute_multi_embedding",
    "regroup_kts",
]
