"""FeatureProcessedEmbeddingBagCollection: feature processors, then a weighted EBC.

    fp_ebc = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(tables, is_weighted=True),
        PositionWeightedModuleCollection({"f1": 20}),  # or {"f1": PositionWeightedModule(20)}
    )
    fp_ebc(kjt)  # KeyedTensor, as the EBC's: the ids of f1 pooled with their position weights

The processors set the weights of the ids (any weights the input carries are replaced), so the
EBC must be weighted. Processors come as a `FeatureProcessorsCollection` (features it does not
list get weight 1) or as a dict with one `FeatureProcessor` per feature of the EBC.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch
from torch import nn

from recshard.modules.embedding_configs import EmbeddingBagConfig
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.modules.feature_processor_ import (
    FeatureProcessor,
    FeatureProcessorsCollection,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
    position_length_error,
    with_weights,
)
from recshard.sparse import KeyedJaggedTensor, KeyedTensor
from recshard.sparse.conversion import jagged_by_index


def apply_feature_processors_to_kjt(
    features: KeyedJaggedTensor,
    feature_processors: Mapping[str, nn.Module],
    feature_of: Mapping[str, str] | None = None,
) -> KeyedJaggedTensor:
    """`features` with each key's weights set by its processor (1.0 for keys without one).
    `feature_of` maps a key to the feature whose processor it uses (default: itself). A
    processor's error is raised again naming the feature (a processor sees one `JaggedTensor`
    and cannot name it): the plain built-in types with the feature in the message, others
    keep their type and get a note naming it."""
    weights: List[torch.Tensor] = []
    for key, jt in zip(features.keys(), jagged_by_index(features)):
        feature = feature_of[key] if feature_of else key
        processor = feature_processors.get(feature)
        if processor is None:
            weights.append(torch.ones(jt.values().numel(), device=jt.values().device))
            continue
        try:
            weights.append(processor(jt).weights())
        except Exception as e:
            named = f"feature '{feature}'" + (f" (as '{key}')" if key != feature else "")
            if type(e) in (ValueError, IndexError, RuntimeError, KeyError, TypeError):
                raise type(e)(f"{named}: {e}") from e
            e.add_note(f"raised by the processor of {named}")  # its own type: keep it
            raise
    if not weights:
        return features
    return with_weights(features, torch.cat(weights))


Processors = nn.ModuleDict | FeatureProcessorsCollection


def position_weights_of(processors: Processors) -> Dict[str, nn.Parameter]:
    """The position-weight parameter of each position-weighted feature of `processors`."""
    if isinstance(processors, PositionWeightedModuleCollection):
        return dict(processors.position_weights)
    if isinstance(processors, nn.ModuleDict):
        return {
            f: p.position_weight
            for f, p in processors.items()
            if isinstance(p, PositionWeightedModule)
        }
    return {}


def other_processors_of(processors: Processors) -> Processors | None:
    """The processors that are not position weights (a dict by feature, or a whole
    collection), None if all are: they see each bag's ids and need each bag whole."""
    if isinstance(processors, PositionWeightedModuleCollection):
        return None
    if isinstance(processors, FeatureProcessorsCollection):
        return processors
    others = {f: p for f, p in processors.items() if not isinstance(p, PositionWeightedModule)}
    return nn.ModuleDict(others) if others else None


class FeatureProcessorDictWrapper(FeatureProcessorsCollection):
    """A dict of per-feature processors seen as one collection."""

    def __init__(self, feature_processors: nn.ModuleDict) -> None:
        super().__init__()
        self._feature_processors = feature_processors

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return apply_feature_processors_to_kjt(features, dict(self._feature_processors))


class FeatureProcessedEmbeddingBagCollection(nn.Module):
    """An `EmbeddingBagCollection` (weighted) whose input first goes through feature
    processors. Output: the EBC's `KeyedTensor`."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        feature_processors: Dict[str, FeatureProcessor] | FeatureProcessorsCollection,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if not embedding_bag_collection.is_weighted():
            raise ValueError(
                f"{owner}: the EmbeddingBagCollection must be built with is_weighted=True "
                "(the feature processors give the ids their weights)"
            )
        self._embedding_bag_collection = embedding_bag_collection
        self._feature_names: List[str] = list(
            dict.fromkeys(
                f for c in embedding_bag_collection.embedding_bag_configs() for f in c.feature_names
            )
        )
        self._feature_processors: nn.ModuleDict | FeatureProcessorsCollection
        if isinstance(feature_processors, FeatureProcessorsCollection):
            self._feature_processors = feature_processors
        else:
            if set(feature_processors) != set(self._feature_names):
                raise ValueError(
                    f"{owner}: feature processors are given for {sorted(feature_processors)}, "
                    f"the EmbeddingBagCollection reads {sorted(self._feature_names)} "
                    "(a dict needs one processor per feature)"
                )
            self._feature_processors = nn.ModuleDict(feature_processors)

    def split(self) -> Tuple[FeatureProcessorsCollection, EmbeddingBagCollection]:
        """The processors as one collection, and the EBC."""
        if isinstance(self._feature_processors, nn.ModuleDict):
            return FeatureProcessorDictWrapper(
                self._feature_processors
            ), self._embedding_bag_collection
        return self._feature_processors, self._embedding_bag_collection

    def is_weighted(self) -> bool:
        return self._embedding_bag_collection.is_weighted()

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        """The EBC's tables (what the planner shards; their input is weighted)."""
        return self._embedding_bag_collection.embedding_bag_configs()

    def position_weights(self) -> Dict[str, nn.Parameter]:
        """The position-weight parameter of each position-weighted feature."""
        return position_weights_of(self._feature_processors)

    def max_feature_lengths(self) -> Dict[str, int]:
        """Each position-weighted feature's longest allowed bag."""
        return {f: int(p.numel()) for f, p in self.position_weights().items()}

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """`features` [F x B x L] -> processors -> EBC: `KeyedTensor` of pooled embeddings."""
        owner = type(self).__name__
        error = position_length_error(features, self.max_feature_lengths(), owner)
        if error is not None:
            raise ValueError(error)
        if isinstance(self._feature_processors, FeatureProcessorsCollection):
            return self._embedding_bag_collection(self._feature_processors(features))
        missing = [f for f in self._feature_names if f not in features.keys()]
        if missing:
            raise ValueError(f"{owner}: features {missing} are missing from the input")
        processed = features.permute([features.keys().index(f) for f in self._feature_names])
        processed = apply_feature_processors_to_kjt(processed, dict(self._feature_processors))
        return self._embedding_bag_collection(processed)
