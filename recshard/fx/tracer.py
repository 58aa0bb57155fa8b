"""`Tracer` and `symbolic_trace`: torch.fx over a model whose embedding modules stay leaves.

The embedding collections (float and quantized, and the feature-processed EBC), the feature
processors and sharded modules become single `call_module` nodes: their forwards check and
route data (per-key splits, id bounds, bag lengths against `max_feature_length`), which
symbolic proxies cannot carry, and a leaf runs the real module when the `GraphModule` runs. So
the graph holds the dense code around them (`kt.values()`, reshapes, the MLPs) and the
traced model computes what the original does. `leaf_modules` adds class names as leaves, as
TorchRec's tracer does. Tracing one of these modules itself gives a graph of one call to it
(held as the `GraphModule`'s submodule `module`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from recshard.modules import EmbeddingBagCollection, EmbeddingCollection
from recshard.modules.feature_processor import BaseFeatureProcessor, BaseGroupedFeatureProcessor
from recshard.modules.feature_processor_ import FeatureProcessor, FeatureProcessorsCollection
from recshard.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recshard.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recshard.types import ShardedModule

# unsharded modules whose forward checks data: leaves, and wrapped when traced themselves
_DATA_CHECKING_TYPES: Tuple[type, ...] = (
    EmbeddingBagCollection,
    EmbeddingCollection,
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    FeatureProcessedEmbeddingBagCollection,
    FeatureProcessor,
    FeatureProcessorsCollection,
    BaseFeatureProcessor,
    BaseGroupedFeatureProcessor,
)
LEAF_TYPES: Tuple[type, ...] = (*_DATA_CHECKING_TYPES, ShardedModule)

_tracing = False


def is_fx_tracing() -> bool:
    """True while a `recshard.fx.Tracer` traces."""
    return _tracing


class Tracer(torch.fx.Tracer):
    """torch.fx tracer that keeps recshard's embedding modules (and any module whose class
    name is in `leaf_modules`) as leaves."""

    def __init__(self, leaf_modules: List[str] | None = None) -> None:
        super().__init__()
        self._leaf_modules: List[str] = list(leaf_modules or [])

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, LEAF_TYPES) or type(m).__name__ in self._leaf_modules:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(
        self, root: nn.Module | Callable[..., Any], concrete_args: Dict[str, Any] | None = None
    ) -> torch.fx.Graph:
        global _tracing
        previous, _tracing = _tracing, True
        try:
            return super().trace(root, concrete_args)
        finally:
            _tracing = previous


class _LeafRoot(nn.Module):
    """Holds a leaf module traced as the root, so that the graph can call it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, features: Any) -> Any:
        return self.module(features)


def symbolic_trace(
    root: nn.Module | Callable[..., Any],
    concrete_args: Dict[str, Any] | None = None,
    leaf_modules: List[str] | None = None,
) -> torch.fx.GraphModule:
    """`root` traced with `Tracer(leaf_modules)` into a `GraphModule`."""
    if isinstance(root, _DATA_CHECKING_TYPES):
        root = _LeafRoot(root)
    graph = Tracer(leaf_modules).trace(root, concrete_args)
    name = type(root).__name__ if isinstance(root, nn.Module) else root.__name__
    return torch.fx.GraphModule(root if isinstance(root, nn.Module) else nn.Module(), graph, name)
