"""Embedding collections behind managed collision: raw ids -> rows -> embeddings.

forward(features) = remap the raw ids (`ManagedCollisionCollection`), reset the rows just given
to new ids (their weights re-drawn by the table's init, as TorchRec's sharded modules do before
the lookup), look up the rows. Returns `(embeddings, remapped KJT or None)`.

Deliberate difference: TorchRec's unsharded modules leave evicted rows as they were (its
`evict` is a no-op); here they are reset as in TorchRec's sharded modules, so the unsharded
module is the reference the sharded one equals.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from recshard.modules.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from recshard.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recshard.modules.mc_modules import ManagedCollisionCollection
from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


@torch.no_grad()
def reset_rows(
    weight: torch.Tensor,
    rows: torch.Tensor,
    config: BaseEmbeddingConfig,
    in_place_data: bool,
    col_offset: int = 0,
) -> None:
    """Re-draw `weight[rows]` (`rows` local to `weight`, its columns from `col_offset`) with
    the table's init, drawn for whole rows (a column shard gets its columns of them)."""
    fresh = weight.new_empty(rows.numel(), config.embedding_dim)
    config.init_weight(fresh)
    target = weight.data if in_place_data else weight
    target[rows] = fresh[:, col_offset : col_offset + weight.size(1)]


class BaseManagedCollisionEmbeddingCollection(nn.Module):
    """An EmbeddingBagCollection or EmbeddingCollection fed by a ManagedCollisionCollection
    over the same tables."""

    def __init__(
        self,
        embedding_module: EmbeddingBagCollection | EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__()
        configs = _configs_of(embedding_module)
        mc_configs = managed_collision_collection.embedding_configs()
        if [c.name for c in configs] != [c.name for c in mc_configs] or any(
            a.num_embeddings != b.num_embeddings or a.feature_names != b.feature_names
            for a, b in zip(configs, mc_configs)
        ):
            raise ValueError(
                f"{type(self).__name__}: the embedding module's tables "
                f"{[(c.name, c.num_embeddings, c.feature_names) for c in configs]} differ from the "
                f"managed collision collection's "
                f"{[(c.name, c.num_embeddings, c.feature_names) for c in mc_configs]}"
            )
        self._embedding_module = embedding_module
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features
        self._allow_in_place_embed_weight_update = allow_in_place_embed_weight_update

    def forward(
        self, features: KeyedJaggedTensor
    ) -> Tuple[KeyedTensor | Dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        remapped = self._managed_collision_collection(features)
        self._reset_evicted(self._managed_collision_collection.evict())
        embeddings = self._embedding_module(remapped)
        return embeddings, (remapped if self._return_remapped_features else None)

    def _reset_evicted(self, evictions: Dict[str, torch.Tensor | None]) -> None:
        tables = getattr(self._embedding_module, _tables_attr(self._embedding_module))
        configs = {c.name: c for c in _configs_of(self._embedding_module)}
        for table, rows in evictions.items():
            if rows is not None and rows.numel():
                reset_rows(
                    tables[table].weight,
                    rows,
                    configs[table],
                    self._allow_in_place_embed_weight_update,
                )


def _configs_of(module: nn.Module) -> List[BaseEmbeddingConfig]:
    if isinstance(module, EmbeddingBagCollection):
        return list(module.embedding_bag_configs())
    return list(module.embedding_configs())  # type: ignore[operator]


def _tables_attr(module: nn.Module) -> str:
    return "embedding_bags" if isinstance(module, EmbeddingBagCollection) else "embeddings"


class ManagedCollisionEmbeddingBagCollection(BaseManagedCollisionEmbeddingCollection):
    """Managed collision in front of an EmbeddingBagCollection: `(KeyedTensor, KJT | None)`."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        if not isinstance(embedding_bag_collection, EmbeddingBagCollection):
            raise TypeError(
                "ManagedCollisionEmbeddingBagCollection takes an EmbeddingBagCollection, got "
                f"{type(embedding_bag_collection).__name__}"
            )
        super().__init__(
            embedding_bag_collection,
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @property
    def _embedding_bag_collection(self) -> EmbeddingBagCollection:
        return self._embedding_module  # type: ignore[return-value]

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        """The tables (what plans and the planner read)."""
        return self._embedding_bag_collection.embedding_bag_configs()

    def is_weighted(self) -> bool:
        return self._embedding_bag_collection.is_weighted()


class ManagedCollisionEmbeddingCollection(BaseManagedCollisionEmbeddingCollection):
    """Managed collision in front of an EmbeddingCollection: `({feature: JT}, KJT | None)`."""

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        if not isinstance(embedding_collection, EmbeddingCollection):
            raise TypeError(
                "ManagedCollisionEmbeddingCollection takes an EmbeddingCollection, got "
                f"{type(embedding_collection).__name__}"
            )
        super().__init__(
            embedding_collection,
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @property
    def _embedding_collection(self) -> EmbeddingCollection:
        return self._embedding_module  # type: ignore[return-value]

    def embedding_configs(self) -> List[EmbeddingConfig]:
        """The tables (what plans and the planner read)."""
        return self._embedding_collection.embedding_configs()
