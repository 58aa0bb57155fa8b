"""Keyed optimizers: fused (in-backward) embedding optimizer, dense wrappers, combination."""

from recshard.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from recshard.optim.fused import FusedOptimizer
from recshard.optim.keyed import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerWrapper,
    in_backward_optimizer_filter,
)
from recshard.optim.rowwise_adagrad import RowWiseAdagrad

__all__ = [
    "CombinedOptimizer",
    "FusedOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "RowWiseAdagrad",
    "apply_optimizer_in_backward",
    "in_backward_optimizer_filter",
]
