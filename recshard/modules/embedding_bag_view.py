"""A plain `torch.nn.EmbeddingBag` seen as a one-table `EmbeddingBagCollection`.

The planner, the plan helpers and the sharded collections take a bag through this view as
they take a collection (TorchRec's `EmbeddingBagSharder` shards a bag the same way). Its one
table is named `weight`, the bag's parameter, so a plan for the bag reads
`{"weight": ParameterSharding}` as TorchRec's does; its one feature is `input`, the argument
of the bag's `forward`. A 'sum' bag is a weighted SUM table (per-id weights of one when none
are given: the same sums), a 'mean' bag an unweighted MEAN table; 'max' has no pooled kernel.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from recshard.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

BAG_TABLE = "weight"
BAG_FEATURE = "input"

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
_DATA_TYPE = {torch.float32: DataType.FP32, torch.float16: DataType.FP16}


def embedding_bag_config(bag: nn.EmbeddingBag) -> EmbeddingBagConfig:
    """The table config of `bag` (its rows, dim, pooling and dtype)."""
    if bag.mode not in _POOLING:
        raise ValueError(
            f"nn.EmbeddingBag(mode={bag.mode!r}) cannot be sharded: sharded bags pool "
            f"'sum' or 'mean'"
        )
    dtype = bag.weight.dtype
    if dtype not in _DATA_TYPE:
        raise ValueError(
            f"nn.EmbeddingBag with {dtype} weights cannot be sharded: float32 or float16"
        )
    return EmbeddingBagConfig(
        num_embeddings=bag.num_embeddings,
        embedding_dim=bag.embedding_dim,
        name=BAG_TABLE,
        feature_names=[BAG_FEATURE],
        pooling=_POOLING[bag.mode],
        data_type=_DATA_TYPE[dtype],
    )


class EmbeddingBagView(nn.Module):
    """`bag` as a collection of one table (`embedding_bags["weight"]` is `bag` itself, so
    its weight and any optimizer attached to it are the ones read)."""

    def __init__(self, bag: nn.EmbeddingBag) -> None:
        super().__init__()
        self._config = embedding_bag_config(bag)
        self.embedding_bags = nn.ModuleDict({BAG_TABLE: bag})

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return [self._config]

    def is_weighted(self) -> bool:
        return self._config.pooling == PoolingType.SUM
