"""Which modules hold embedding tables, and their table configs: one answer for the plan
helpers, the plan validator, DMP's plan agreement and the planner."""

from __future__ import annotations

from typing import List, Tuple

from torch import nn

from recshard.modules.embedding_bag_view import embedding_bag_config
from recshard.modules.embedding_configs import BaseEmbeddingConfig


def holds_tables(module: nn.Module) -> bool:
    """An embedding collection, or a plain `nn.EmbeddingBag`."""
    return type(module) is nn.EmbeddingBag or any(
        hasattr(module, getter) for getter in ("embedding_bag_configs", "embedding_configs")
    )


def embedding_tables(module: nn.Module) -> Tuple[List[BaseEmbeddingConfig], bool] | None:
    """A collection's table configs and whether it pools (a plain `nn.EmbeddingBag`: its one
    table, `embedding_bag_view.py`); None for a module without tables."""
    if type(module) is nn.EmbeddingBag:
        return [embedding_bag_config(module)], True
    if hasattr(module, "embedding_bag_configs"):
        return list(module.embedding_bag_configs()), True
    if hasattr(module, "embedding_configs"):
        return list(module.embedding_configs()), False
    return None
