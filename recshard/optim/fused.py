"""The fused embedding optimizer as a KeyedOptimizer.

Its update already happened inside the lookup kernels' backward; `step()` and `zero_grad()`
only push the current learning rate into the kernels, so `torch.optim.lr_scheduler` works.
Params are the local table shards keyed by table FQN (e.g. `ebc.embedding_bags.t0.weight`),
state the optimizer's per-shard tensors (`momentum1` for Adagrad variants), shared with the
kernels (in place). `state_dict()` gives each table's state as ShardedTensors with the global
layout (`recshard.distributed.sharded_state.fused_state`), so `torch.distributed.checkpoint` saves
every rank's part and loads it into any world size; `load_state_dict` copies into the live state.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Set

import torch

from recshard.optim.keyed import KeyedOptimizer, copy_into

ShardedState = Callable[[], Dict[str, Dict[str, Any]]]


class FusedOptimizer(KeyedOptimizer):
    """`kernels`: fused lookup kernels; `param_names[i]` lists FQNs of kernel i's tables;
    `sharded_state()`: `{table fqn: {state name: ShardedTensor}}` over the live state."""

    def __init__(
        self, kernels: List[Any], param_names: List[List[str]], sharded_state: ShardedState
    ) -> None:
        params: Dict[str, torch.Tensor] = {}
        state: Dict[torch.Tensor, Dict[str, Any]] = {}
        groups: List[Dict[str, Any]] = []
        for kernel, names in zip(kernels, param_names):
            tensors = []
            for name, weight, states in zip(
                names, kernel.table_weights(), kernel.optimizer_states()
            ):
                params[name] = weight
                state[weight] = dict(states)
                tensors.append(weight)
            groups.append(
                {
                    "params": tensors,
                    "lr": kernel.spec.learning_rate,
                    "optimizer": kernel.spec.optim.value,
                }
            )
        self._kernels = kernels
        self._sharded_state = sharded_state
        super().__init__(params, state, groups)

    def state_dict(self) -> Dict[str, Any]:
        """`{"state": {table fqn: {name: ShardedTensor}}}`, plus `"param_groups"` after
        `save_param_groups(True)`."""
        return {**super().state_dict(), "state": self._sharded_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy each saved state into this rank's shards of the live state (in place)."""
        saved = state_dict["state"]
        for fqn, entry in self._sharded_state().items():
            if fqn not in saved:
                raise ValueError(f"optimizer state for '{fqn}' is missing from the checkpoint")
            for name, target in entry.items():
                if name not in saved[fqn]:
                    raise ValueError(
                        f"optimizer state '{fqn}.{name}' is missing from the checkpoint"
                    )
                copy_into(target, saved[fqn][name], f"{fqn}.{name}")
        self._load_param_groups(state_dict)
        self._push_learning_rates()

    def _push_learning_rates(self) -> None:
        for kernel, group in zip(self._kernels, self.param_groups):
            kernel.set_learning_rate(float(group["lr"]))

    def step(self, closure: Any = None) -> None:  # noqa: ANN401
        self._push_learning_rates()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._push_learning_rates()

    def init_state(self, sparse_grad_parameter_names: Set[str] | None = None) -> None:
        """Nothing to do: the kernels hold their state from construction (and a gradient set
        on a fused table would only waste its size in memory)."""
