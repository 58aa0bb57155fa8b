"""ManagedCollisionCollection: one managed collision module per table, KJT in, KJT out."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn

from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.modules.mc_base import ManagedCollisionModule
from recshard.sparse import KeyedJaggedTensor


class ManagedCollisionCollection(nn.Module):
    """One managed collision module per table: remaps a KJT of raw ids to a KJT of rows.

    The output's keys are the tables' features in config order (as TorchRec); weights pass
    through. Every feature of a table goes through that table's module.
    """

    def __init__(
        self,
        managed_collision_modules: Dict[str, ManagedCollisionModule],
        embedding_configs: Sequence[BaseEmbeddingConfig],
        need_preprocess: bool = True,
    ) -> None:
        super().__init__()
        tables = [c.name for c in embedding_configs]
        extra = sorted(set(managed_collision_modules) - set(tables))
        if extra:
            raise ValueError(
                f"ManagedCollisionCollection: modules {extra} have no table in {tables}"
            )
        for config in embedding_configs:
            module = managed_collision_modules.get(config.name)
            if module is None:
                raise ValueError(
                    f"ManagedCollisionCollection: table '{config.name}' has no managed "
                    "collision module"
                )
            if module.output_size() != config.num_embeddings:
                raise ValueError(
                    f"ManagedCollisionCollection: table '{config.name}' has "
                    f"{config.num_embeddings} "
                    f"rows but its managed collision module maps to {module.output_size()} "
                    "(zch_size must equal num_embeddings)"
                )
        self._managed_collision_modules = nn.ModuleDict(
            {c.name: managed_collision_modules[c.name] for c in embedding_configs}
        )
        self._embedding_configs = list(embedding_configs)
        self.need_preprocess = need_preprocess
        self._table_to_features = {c.name: list(c.feature_names) for c in embedding_configs}
        self._feature_to_table = {f: c.name for c in embedding_configs for f in c.feature_names}
        self._feature_names = [f for c in embedding_configs for f in c.feature_names]
        if len(set(self._feature_names)) != len(self._feature_names):
            raise ValueError(
                "ManagedCollisionCollection: a feature is read by two tables "
                f"({self._feature_names})"
            )

    def embedding_configs(self) -> List[BaseEmbeddingConfig]:
        return self._embedding_configs

    def feature_names(self) -> List[str]:
        return self._feature_names

    def modules_by_table(self) -> Dict[str, ManagedCollisionModule]:
        return dict(self._managed_collision_modules.items())  # type: ignore[arg-type]

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """KJT of raw ids (any key order, these features only) -> KJT of rows."""
        keys = features.keys()
        missing = [f for f in self._feature_names if f not in keys]
        unknown = [k for k in keys if k not in self._feature_to_table]
        if missing or unknown:
            raise ValueError(
                f"ManagedCollisionCollection: input features {keys} do not match the tables' "
                f"features {self._feature_names} (missing {missing}, unknown {unknown})"
            )
        ordered = features.permute([keys.index(f) for f in self._feature_names])
        jts = ordered.to_dict()
        remapped: List[torch.Tensor] = []
        for table, module in self._managed_collision_modules.items():
            out = module({f: jts[f] for f in self._table_to_features[table]})
            remapped += [out[f].values() for f in self._table_to_features[table]]
        values = torch.cat(remapped) if remapped else ordered.values()
        return KeyedJaggedTensor(
            keys=self._feature_names,
            values=values,
            weights=ordered.weights_or_none(),
            lengths=ordered.lengths(),
            stride=ordered.stride(),
        )

    def evict(self) -> Dict[str, torch.Tensor | None]:
        return {t: m.evict() for t, m in self._managed_collision_modules.items()}

    def metrics(self, reset: bool = True) -> Dict[str, Dict[str, float]]:
        """Per table: the module's `metrics()` (lookups, hits, hit rate, ids admitted and
        evicted since the last reset; rows in use, open slots)."""
        return {
            t: m.metrics(reset)  # type: ignore[operator]
            for t, m in self._managed_collision_modules.items()
            if hasattr(m, "metrics")
        }

    def open_slots(self) -> Dict[str, torch.Tensor]:
        return {t: m.open_slots() for t, m in self._managed_collision_modules.items()}
