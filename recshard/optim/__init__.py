"""Keyed optimizers: fused (in-backward) embedding optimizer, dense wrappers, combination,
learning-rate warm-up, gradient clipping."""

from recshard.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from recshard.optim.clipping import GradientClipping, GradientClippingOptimizer
from recshard.optim.fused import FusedOptimizer
from recshard.optim.keyed import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerWrapper,
    in_backward_optimizer_filter,
)
from recshard.optim.rowwise_adagrad import RowWiseAdagrad
from recshard.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

__all__ = [
    "CombinedOptimizer",
    "FusedOptimizer",
    "GradientClipping",
    "GradientClippingOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "RowWiseAdagrad",
    "WarmupOptimizer",
    "WarmupPolicy",
    "WarmupStage",
    "apply_optimizer_in_backward",
    "in_backward_optimizer_filter",
]
