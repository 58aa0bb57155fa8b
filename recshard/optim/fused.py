"""The fused embedding optimizer as a KeyedOptimizer.

Its update already happened inside the lookup kernels' backward; `step()` and `zero_grad()`
only push the current learning rate into the kernels, so `torch.optim.lr_scheduler` works.
Params are the local table shards keyed by table FQN (e.g. `ebc.embedding_bags.t0.weight`),
state the optimizer's per-shard tensors (`momentum1` for Adagrad variants), shared with the
kernels (in place).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch

from recshard.optim.keyed import KeyedOptimizer


class FusedOptimizer(KeyedOptimizer):
    """`kernels`: fused lookup kernels; `param_names[i]` lists FQNs of kernel i's tables."""

    def __init__(self, kernels: List[Any], param_names: List[List[str]]) -> None:
        params: Dict[str, torch.Tensor] = {}
        state: Dict[torch.Tensor, Dict[str, Any]] = {}
        groups: List[Dict[str, Any]] = []
        for kernel, names in zip(kernels, param_names):
            tensors = []
            for name, weight, states in zip(names, kernel.table_weights(), kernel.optimizer_states()):
                params[name] = weight
                state[weight] = dict(states)
                tensors.append(weight)
            groups.append({"params": tensors, "lr": kernel.spec.learning_rate,
                           "optimizer": kernel.spec.optim.value})
        self._kernels = kernels
        super().__init__(params, state, groups)

    def _push_learning_rates(self) -> None:
        for kernel, group in zip(self._kernels, self.param_groups):
            kernel.set_learning_rate(float(group["lr"]))

    def step(self, closure: Any = None) -> None:  # noqa: ANN401
        self._push_learning_rates()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._push_learning_rates()

    def init_state(self, sparse_grad_parameter_names: Optional[Set[str]] = None) -> None:
        """Nothing to do: the kernels hold their state from construction (and a gradient set
        on a fused table would only waste its size in memory)."""
