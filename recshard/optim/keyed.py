"""Optimizers keyed by parameter FQN, so their state can be sharded and checkpointed like the
model's state, and several of them can stand behind one `step()`.

They subclass `torch.optim.Optimizer`, so `torch.optim.lr_scheduler` drives them: a scheduler
edits `param_groups[i]["lr"]`, and `CombinedOptimizer.param_groups` are the sub-optimizers'
own group dicts, so the change reaches each of them (the fused ones push it into their kernels).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Tuple, Union

import torch
from torch import nn
from torch.optim import Optimizer

OptimizerFactory = Callable[[List[torch.Tensor]], Optimizer]


class KeyedOptimizer(Optimizer):
    """Params as `{fqn: tensor}`, state as `{tensor: {name: value}}`; `state_dict()` keys state
    by fqn: `{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}`."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        state: Mapping[torch.Tensor, Any],
        param_groups: List[Dict[str, Any]],
    ) -> None:
        # Not Optimizer.__init__: groups hold tensors that may not be leaves (fused views).
        self.defaults: Dict[str, Any] = {}
        self._optimizer_step_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_step_post_hooks: Dict[int, Callable] = {}
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = {}
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = {}
        self.params = dict(params)
        self.state = state  # type: ignore[assignment]
        self.param_groups = param_groups

    def _fqn(self) -> Dict[int, str]:
        return {id(t): name for name, t in self.params.items()}

    def state_dict(self) -> Dict[str, Any]:
        names = self._fqn()
        state = {names[id(p)]: dict(s) for p, s in self.state.items() if id(p) in names}
        groups = []
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = [names[id(p)] for p in group["params"]]
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy saved state into the live state tensors (in place: fused kernels hold them)."""
        saved = state_dict["state"]
        names = self._fqn()
        for param, current in self.state.items():
            fqn = names.get(id(param))
            if fqn is None:
                continue
            if fqn not in saved:
                raise ValueError(f"optimizer state for '{fqn}' is missing from the checkpoint")
            for key, value in saved[fqn].items():
                if key not in current:
                    current[key] = value
                elif isinstance(current[key], torch.Tensor):
                    copy_into(current[key], value, f"{fqn}.{key}")
                else:
                    current[key] = value
        for group, saved_group in zip(self.param_groups, state_dict.get("param_groups", [])):
            for key, value in saved_group.items():
                if key != "params":
                    group[key] = value

    def init_state(self) -> None:
        """Materialize lazy optimizer state (torch optimizers create it on the first step)."""


def copy_into(target: torch.Tensor, value: Any, what: str) -> None:
    """Copy a saved value into live state: shard by shard when both are sharded (the saved
    one already in the target's layout, as `torch.distributed.checkpoint.load` leaves it)."""
    if hasattr(value, "local_shards") and hasattr(target, "local_shards"):
        for dst, src in zip(target.local_shards(), value.local_shards(), strict=True):
            if tuple(dst.metadata.shard_offsets) != tuple(src.metadata.shard_offsets):
                raise ValueError(f"optimizer state '{what}': saved shard at "
                                 f"{src.metadata.shard_offsets}, this rank holds "
                                 f"{dst.metadata.shard_offsets} (load it with torch.distributed.checkpoint)")
            dst.tensor.copy_(src.tensor)
        return
    source = value.local_tensor() if hasattr(value, "local_tensor") else value
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"optimizer state '{what}': checkpoint shape {tuple(source.shape)} "
                         f"!= model shape {tuple(target.shape)}")
    target.copy_(source)


class KeyedOptimizerWrapper(KeyedOptimizer):
    """A torch optimizer over named params, keyed by name:
    `KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1))`."""

    def __init__(self, params: Mapping[str, torch.Tensor], optim_factory: OptimizerFactory) -> None:
        self._optimizer = optim_factory(list(params.values()))
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)

    def step(self, closure: Any = None) -> Any:  # noqa: ANN401
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none)

    def init_state(self) -> None:
        """Create the state of parameters that have none yet (torch optimizers create it on
        their first step) with one zero-gradient, zero-lr step over those parameters only;
        existing state and pending gradients are left exactly as they were."""
        missing = [p for p in self.params.values() if p.requires_grad and not self.state.get(p)]
        if not missing:
            return
        stashed = {id(p): p.grad for p in self.params.values()}
        lrs = [g["lr"] for g in self.param_groups]
        try:
            for p in self.params.values():
                p.grad = None
            for p in missing:
                p.grad = torch.zeros_like(p)
            for g in self.param_groups:
                g["lr"] = 0.0
            self._optimizer.step()
        finally:
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = lr
            for p in self.params.values():
                p.grad = stashed[id(p)]


class CombinedOptimizer(KeyedOptimizer):
    """Several keyed optimizers behind one `step()`, `zero_grad()` and `state_dict()`.

    Items are optimizers or `(prefix, optimizer)`; a prefix is prepended to the FQNs.
    """

    def __init__(self, optims: Iterable[Union[KeyedOptimizer, Tuple[str, KeyedOptimizer]]]) -> None:
        self.optimizers: List[Tuple[str, KeyedOptimizer]] = [
            o if isinstance(o, tuple) else ("", o) for o in optims
        ]
        params: Dict[str, torch.Tensor] = {}
        state: Dict[torch.Tensor, Any] = {}
        groups: List[Dict[str, Any]] = []
        for prefix, opt in self.optimizers:
            for name, tensor in opt.params.items():
                key = _join(prefix, name)
                if key in params:
                    raise ValueError(f"CombinedOptimizer: parameter '{key}' is in two optimizers")
                params[key] = tensor
            state.update(opt.state)
            groups.extend(opt.param_groups)
        super().__init__(params, state, groups)

    def state_dict(self) -> Dict[str, Any]:
        """Each optimizer's own state dict (fused ones give ShardedTensors), FQNs prefixed."""
        state: Dict[str, Any] = {}
        groups: List[Dict[str, Any]] = []
        for prefix, opt in self.optimizers:
            own = opt.state_dict()
            state.update({_join(prefix, fqn): entry for fqn, entry in own["state"].items()})
            groups.extend({**g, "params": [_join(prefix, p) for p in g["params"]]}
                          for g in own["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Hand each optimizer its part (prefix removed, its own number of param groups)."""
        groups = list(state_dict.get("param_groups", []))
        for prefix, opt in self.optimizers:
            head = f"{prefix}." if prefix else ""
            own_groups, groups = groups[:len(opt.param_groups)], groups[len(opt.param_groups):]
            opt.load_state_dict({
                "state": {k[len(head):]: v for k, v in state_dict["state"].items() if k.startswith(head)},
                "param_groups": [{**g, "params": [p[len(head):] for p in g["params"]]} for g in own_groups],
            })

    def step(self, closure: Any = None) -> None:  # noqa: ANN401
        for _, opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def init_state(self) -> None:
        for _, opt in self.optimizers:
            opt.init_state()


def _join(prefix: str, fqn: str) -> str:
    return f"{prefix}.{fqn}" if prefix else fqn


def in_backward_optimizer_filter(
    named_parameters: Iterable[Tuple[str, nn.Parameter]], include: bool = False
) -> Iterable[Tuple[str, nn.Parameter]]:
    """Parameters updated by a fused (in-backward) optimizer, or (default) all the others."""
    for name, param in named_parameters:
        if bool(getattr(param, "_in_backward_optimizers", False)) == include:
            yield name, param
