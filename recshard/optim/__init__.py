"""Keyed optimizers: fused (in-backward) embedding optimizer, dense wrappers, combination."""

from recshard.optim.fused import FusedOptimizer
from recshard.optim.keyed import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerWrapper,
    in_backward_optimizer_filter,
)

__all__ = [
    "CombinedOptimizer",
    "FusedOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "in_backward_optimizer_filter",
]
