"""The fused embedding optimizer as a KeyedOptimizer.

Its update already happened inside the lookup kernels' backward; `step()` and `zero_grad()`
only push the current learning rate into the kernels, so `torch.optim.lr_scheduler` works.
Params are the local table shards keyed by table FQN (e.g. `ebc.embedding_bags.t0.weight`),
state the optimizer's per-shard tensors under TorchRec's names (`t0.momentum1` for Adagrad
variants, Adam's `t0.momentum1` and `t0.exp_avg_sq`), shared with the kernels (in place).
`state_dict()` gives each table's state as ShardedTensors with the global layout
(`recshard.distributed.sharded_state.fused_state`), so `torch.distributed.checkpoint` saves
every rank's part and loads it into any world size; `load_state_dict` copies into the live
state, from ShardedTensors in this layout or from whole tensors in any layout (row-wise state
saved under other column shards converted: `column_state.py`), under TorchRec's keys or
recshard's earlier bare ones (`momentum1`, `momentum2`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Set

import torch

from recshard.optim.column_state import (
    by_state,
    column_blocks,
    fill_rows,
    recshard_key,
    state_key,
    torchrec_key,
)
from recshard.optim.keyed import KeyedOptimizer, copy_into

ShardedState = Callable[[], Dict[str, Dict[str, Any]]]


class FusedOptimizer(KeyedOptimizer):
    """`kernels`: fused lookup kernels; `param_names[i]` lists FQNs of kernel i's tables;
    `sharded_state()`: `{table fqn: {state name: ShardedTensor}}` over the live state;
    `table_dims`: each table's embedding dim by FQN (to convert row-wise state between
    column layouts); `table_names`: each table's name by FQN (its state's key prefix)."""

    def __init__(
        self,
        kernels: List[Any],
        param_names: List[List[str]],
        sharded_state: ShardedState,
        table_dims: Mapping[str, int] | None = None,
        table_names: Mapping[str, str] | None = None,
    ) -> None:
        params: Dict[str, torch.Tensor] = {}
        state: Dict[torch.Tensor, Dict[str, Any]] = {}
        groups: List[Dict[str, Any]] = []
        for kernel, names in zip(kernels, param_names):
            tensors = []
            for name, table, weight, states in zip(
                names,
                [t.name for t in kernel.tables],
                kernel.table_weights(),
                kernel.optimizer_states(),
            ):
                params[name] = weight
                state[weight] = {torchrec_key(table, k): v for k, v in states.items()}
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
        self._table_dims = dict(table_dims or {})
        self._table_names = dict(table_names or {})
        super().__init__(params, state, groups)

    def state_dict(self) -> Dict[str, Any]:
        """`{"state": {table fqn: {"<table>.<state>": ShardedTensor}}}` (TorchRec's keys), plus
        `"param_groups"` after `save_param_groups(True)`."""
        state = {
            fqn: {self._public_key(fqn, key): value for key, value in entry.items()}
            for fqn, entry in self._sharded_state().items()
        }
        return {**super().state_dict(), "state": state}

    def _public_key(self, fqn: str, key: str) -> str:
        table = self._table_names.get(fqn)
        return key if table is None else torchrec_key(table, key)

    def _own_key(self, fqn: str, key: str) -> str:
        table = self._table_names.get(fqn)
        return key if table is None else recshard_key(table, key)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy each saved state into this rank's shards of the live state (in place): from
        ShardedTensors in this layout (as `torch.distributed.checkpoint.load` leaves them) or
        whole tensors; a row-wise state saved whole under another column layout (`momentum1`
        vs `momentum1@col<offset>`) is converted (`column_state.py`)."""
        saved = state_dict["state"]
        for fqn, entry in self._sharded_state().items():
            if fqn not in saved:
                raise ValueError(f"optimizer state for '{fqn}' is missing from the checkpoint")
            given = by_state({self._own_key(fqn, k): v for k, v in saved[fqn].items()})
            for name, targets in by_state(entry).items():
                found = given.get(name, {})
                if found and set(found) != set(targets):
                    self._relayout(fqn, name, targets, found)
                    continue
                for offset, target in targets.items():
                    key = state_key(name, offset)
                    if offset not in found:
                        raise ValueError(
                            f"optimizer state '{fqn}.{key}' is missing from the checkpoint"
                        )
                    copy_into(target, found[offset], f"{fqn}.{key}")
        self._load_param_groups(state_dict)
        self._push_learning_rates()

    def _relayout(
        self, fqn: str, name: str, targets: Dict[int | None, Any], found: Dict[int | None, Any]
    ) -> None:
        """Row-wise state `name` of table `fqn` saved as whole `[rows]` tensors under other
        column shards than this plan's."""
        what = f"optimizer state '{fqn}.{name}'"
        saved_keys = sorted(state_key(name, o) for o in found)
        live_keys = sorted(state_key(name, o) for o in targets)
        rows = next(iter(targets.values())).size()
        sharded = any(_is_sharded(v) for v in found.values())
        if sharded or len(rows) != 1 or fqn not in self._table_dims:
            raise ValueError(
                f"{what}: saved as {saved_keys}, this plan holds {live_keys}; converting "
                f"between column layouts needs whole row-wise tensors of shape {tuple(rows)} "
                f"(ShardedTensors of another plan: load them with recshard.checkpoint.load)"
            )
        for offset, value in found.items():
            if tuple(value.shape) != tuple(rows):
                raise ValueError(
                    f"{what}: '{state_key(name, offset)}' has shape {tuple(value.shape)}, "
                    f"the table has {rows[0]} rows"
                )
        dim = self._table_dims[fqn]
        saved_blocks = column_blocks(found, dim, what)
        target_blocks = column_blocks(targets, dim, what)
        sources = [(saved_blocks[o], partial(v.narrow, 0)) for o, v in found.items()]
        for offset, target in targets.items():
            fill_rows(target, target_blocks[offset], sources)

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


def _is_sharded(value: Any) -> bool:  # noqa: ANN401 - any saved state value
    return hasattr(value, "local_shards") or hasattr(value, "local_tensor")
