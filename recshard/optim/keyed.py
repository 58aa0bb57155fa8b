"""Optimizers keyed by parameter FQN, so their state can be sharded and checkpointed like the
model's state, and several of them can stand behind one `step()`.

They subclass `torch.optim.Optimizer`, so `torch.optim.lr_scheduler` drives them: a scheduler
edits `param_groups[i]["lr"]`, and `CombinedOptimizer.param_groups` are the sub-optimizers'
own group dicts, so the change reaches each of them (the fused ones push it into their kernels).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Set, Tuple

import torch
from torch import nn
from torch.optim import Optimizer

OptimizerFactory = Callable[[Any], Optimizer]  # a list of params, or the dict if asked


class KeyedOptimizer(Optimizer):
    """Params as `{fqn: tensor}`, state as `{tensor: {name: value}}`; `state_dict()` keys state
    by fqn: `{"state": {fqn: {...}}}`, plus `"param_groups": [{..., "params": [fqn, ...]}]`
    after `save_param_groups(True)` (TorchRec's default leaves them out: they are usually
    rebuilt at start-up). State values may be nested dicts or objects with their own
    `state_dict` / `load_state_dict`."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        state: Mapping[torch.Tensor, Any],
        param_groups: List[Dict[str, Any]],
    ) -> None:
        # Not Optimizer.__init__: groups hold tensors that may not be leaves (fused views).
        _init_hooks(self)
        self.params = dict(params)
        self.state = state  # type: ignore[assignment]
        self.param_groups = param_groups
        known = {id(t) for t in self.params.values()}
        strays = [key for key in state if id(key) not in known]
        if strays:
            raise ValueError(
                f"All state keys must be params. The following keys are not: {strays}."
            )

    def __getstate__(self) -> Dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def save_param_groups(self, save: bool) -> None:
        """Whether `state_dict()` carries (and `load_state_dict` restores) the param groups."""
        self.defaults["_save_param_groups"] = save

    def _fqn(self) -> Dict[int, str]:
        return {id(t): name for name, t in self.params.items()}

    def state_dict(self) -> Dict[str, Any]:
        names = self._fqn()
        state = {names[id(p)]: _saved(s) for p, s in self.state.items() if id(p) in names}
        out: Dict[str, Any] = {"state": state}
        if self.defaults.get("_save_param_groups"):
            groups = []
            for group in self.param_groups:
                saved = {k: v for k, v in group.items() if k != "params"}
                saved["params"] = sorted(names[id(p)] for p in group["params"])
                groups.append(saved)
            out["param_groups"] = groups
        return out

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
            _load_into(current, saved[fqn], fqn)
        self._load_param_groups(state_dict)

    def _load_param_groups(self, state_dict: Mapping[str, Any]) -> None:
        """The saved groups' settings (lr, ...), matched by their params, if `save_param_groups`."""
        if not self.defaults.get("_save_param_groups"):
            return
        names = self._fqn()
        if "param_groups" not in state_dict:
            raise ValueError("save_param_groups is on but the checkpoint has no param_groups")
        by_params = {"/".join(g["params"]): g for g in state_dict["param_groups"]}
        for group in self.param_groups:
            key = "/".join(sorted(names[id(p)] for p in group["params"]))
            if key not in by_params:
                raise ValueError(f"param group of {key} is missing from the checkpoint")
            group.update({k: v for k, v in by_params[key].items() if k != "params"})

    def init_state(self, sparse_grad_parameter_names: Set[str] | None = None) -> None:
        """Materialize lazy optimizer state (torch optimizers create it on their first step)
        with one step at lr 0 over the parameters that have none yet, on zero gradients:
        weights do not move and existing state is untouched. A parameter that had a gradient
        gets it back; the others keep the zero one (sparse if named in
        `sparse_grad_parameter_names`), as in TorchRec."""
        sparse_names = sparse_grad_parameter_names or set()
        missing = {
            name for name, p in self.params.items() if p.requires_grad and not self.state.get(p)
        }
        if not missing:
            return
        stashed = {name: p.grad for name, p in self.params.items()}
        lrs = [g.get("lr") for g in self.param_groups]
        try:
            for name, p in self.params.items():
                p.grad = None
                if name in missing:
                    zeros = torch.zeros_like(p)
                    p.grad = zeros.to_sparse() if name in sparse_names else zeros
            for g in self.param_groups:
                if "lr" in g:
                    g["lr"] = 0.0
            self.step()
        finally:
            for g, lr in zip(self.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr
            for name, p in self.params.items():
                if stashed[name] is not None or name not in missing:
                    p.grad = stashed[name]


def _init_hooks(optimizer: Optimizer) -> None:
    """The attributes torch.optim.Optimizer's hooks and schedulers expect."""
    optimizer.defaults = {"_save_param_groups": False}
    optimizer._optimizer_step_pre_hooks = {}
    optimizer._optimizer_step_post_hooks = {}
    optimizer._optimizer_state_dict_pre_hooks = {}
    optimizer._optimizer_state_dict_post_hooks = {}
    optimizer._optimizer_load_state_dict_pre_hooks = {}
    optimizer._optimizer_load_state_dict_post_hooks = {}


def _saved(value: Any) -> Any:  # noqa: ANN401 - optimizer state is heterogeneous
    """A state value as saved: nested dicts walked, stateful objects by their state_dict."""
    if isinstance(value, dict):
        return {k: _saved(v) for k, v in value.items()}
    if not isinstance(value, torch.Tensor) and callable(getattr(value, "state_dict", None)):
        return value.state_dict()
    return value


def _load_into(current: Dict[str, Any], saved: Mapping[str, Any], path: str) -> None:
    for key, value in saved.items():
        what = f"{path}.{key}"
        if key not in current:
            current[key] = value
        elif isinstance(current[key], dict):
            _load_into(current[key], value, what)
        elif isinstance(current[key], torch.Tensor):
            copy_into(current[key], value, what)
        elif callable(getattr(current[key], "load_state_dict", None)):
            current[key].load_state_dict(value)
        else:
            current[key] = value


def copy_into(target: torch.Tensor, value: Any, what: str) -> None:
    """Copy a saved value into live state: shard by shard when both are sharded (the saved
    one already in the target's layout, as `torch.distributed.checkpoint.load` leaves it);
    a whole tensor into a sharded target: each local shard its region of it."""
    if (
        hasattr(target, "local_shards")
        and isinstance(value, torch.Tensor)
        and not hasattr(value, "local_shards")
        and not hasattr(value, "local_tensor")
    ):
        if tuple(target.size()) != tuple(value.shape):
            raise ValueError(
                f"optimizer state '{what}': checkpoint shape {tuple(value.shape)} "
                f"!= model shape {tuple(target.size())}"
            )
        for shard in target.local_shards():
            region = value
            for dim, (start, size) in enumerate(
                zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
            ):
                region = region.narrow(dim, start, size)
            shard.tensor.copy_(region)
        return
    if hasattr(value, "local_shards") and hasattr(target, "local_shards"):
        for dst, src in zip(target.local_shards(), value.local_shards(), strict=True):
            if tuple(dst.metadata.shard_offsets) != tuple(src.metadata.shard_offsets):
                raise ValueError(
                    f"optimizer state '{what}': saved shard at "
                    f"{src.metadata.shard_offsets}, this rank holds "
                    f"{dst.metadata.shard_offsets} (load it with torch.distributed.checkpoint)"
                )
            dst.tensor.copy_(src.tensor)
        return
    source = value.local_tensor() if hasattr(value, "local_tensor") else value
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(
            f"optimizer state '{what}': checkpoint shape {tuple(source.shape)} "
            f"!= model shape {tuple(target.shape)}"
        )
    target.copy_(source)


class KeyedOptimizerWrapper(KeyedOptimizer):
    """A torch optimizer over named params, keyed by name:
    `KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1))`.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        optim_factory: OptimizerFactory,
        pass_params_dict: bool = False,
    ) -> None:
        self._optimizer = optim_factory(params if pass_params_dict else list(params.values()))
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)

    def step(self, closure: Any = None) -> Any:  # noqa: ANN401
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none)


class CombinedOptimizer(KeyedOptimizer):
    """Several keyed optimizers behind one `step()`, `zero_grad()` and `state_dict()`.

    Items are optimizers or `(prefix, optimizer)`; a prefix is prepended to the FQNs.
    `params`, `state` and `param_groups` are live views of the sub-optimizers' (state a
    torch optimizer creates lazily shows up here), so a scheduler editing a group's lr
    reaches the sub-optimizer.
    """

    def __init__(self, optims: Iterable[KeyedOptimizer | Tuple[str, KeyedOptimizer]]) -> None:
        _init_hooks(self)
        self.optimizers: List[Tuple[str, KeyedOptimizer]] = [
            o if isinstance(o, tuple) else ("", o) for o in optims
        ]
        seen = set()
        for prefix, opt in self.optimizers:
            for name in opt.params:
                key = _prefixed(prefix, name)
                if key in seen:
                    raise ValueError(f"CombinedOptimizer: parameter '{key}' is in two optimizers")
                seen.add(key)
        if self.optimizers:
            self.defaults["_save_param_groups"] = bool(
                self.optimizers[0][1].defaults.get("_save_param_groups")
            )

    @property
    def params(self) -> Dict[str, torch.Tensor]:  # type: ignore[override]
        return {
            _prefixed(prefix, name): t
            for prefix, opt in self.optimizers
            for name, t in opt.params.items()
        }

    @property
    def state(self) -> Dict[torch.Tensor, Any]:  # type: ignore[override]
        return {p: s for _, opt in self.optimizers for p, s in opt.state.items()}

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return [g for _, opt in self.optimizers for g in opt.param_groups]

    def save_param_groups(self, save: bool) -> None:
        super().save_param_groups(save)
        for _, opt in self.optimizers:
            opt.save_param_groups(save)

    def state_dict(self) -> Dict[str, Any]:
        """Each optimizer's own state dict (fused ones give ShardedTensors), FQNs prefixed;
        param groups as the parts save them (`save_param_groups`)."""
        state: Dict[str, Any] = {}
        groups: List[Dict[str, Any]] = []
        for prefix, opt in self.optimizers:
            own = opt.state_dict()
            state.update({_prefixed(prefix, fqn): entry for fqn, entry in own["state"].items()})
            groups.extend(
                {**g, "params": sorted(_prefixed(prefix, p) for p in g["params"])}
                for g in own.get("param_groups", [])
            )
        out: Dict[str, Any] = {"state": state}
        if self.defaults.get("_save_param_groups"):
            out["param_groups"] = groups
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Hand each optimizer its part: the entries under its prefix, prefix removed."""
        for prefix, opt in self.optimizers:
            state = {
                name: v
                for k, v in state_dict["state"].items()
                if (name := _unprefixed(prefix, k)) is not None
            }
            part: Dict[str, Any] = {"state": state}
            if "param_groups" in state_dict:
                part["param_groups"] = []
                for group in state_dict["param_groups"]:
                    names = [_unprefixed(prefix, p) for p in group["params"]]
                    if None not in names:
                        part["param_groups"].append({**group, "params": names})
            opt.load_state_dict(part)

    def step(self, closure: Any = None) -> None:  # noqa: ANN401
        for _, opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def init_state(self, sparse_grad_parameter_names: Set[str] | None = None) -> None:
        for prefix, opt in self.optimizers:
            names = None
            if sparse_grad_parameter_names is not None:
                names = {
                    n for n in opt.params if _prefixed(prefix, n) in sparse_grad_parameter_names
                }
            opt.init_state(names)


def _prefixed(prefix: str, name: str) -> str:
    if not name:
        return prefix
    return f"{prefix}.{name}" if prefix else name


def _unprefixed(prefix: str, fqn: str) -> str | None:
    """`fqn` without `prefix`, or None when it is not under it."""
    if not prefix:
        return fqn
    if fqn == prefix:
        return ""
    return fqn[len(prefix) + 1 :] if fqn.startswith(f"{prefix}.") else None


class OptimizerWrapper(KeyedOptimizer):
    """A KeyedOptimizer around another one, to subclass (gradient clipping, warm-up, ...):
    everything is delegated; override `step` to add behaviour. `params`, `state` and
    `param_groups` are live views of the wrapped optimizer's (state it creates lazily, or
    replaces in `load_state_dict`, shows up here)."""

    def __init__(self, optimizer: KeyedOptimizer) -> None:
        _init_hooks(self)
        self._optimizer = optimizer

    @property
    def params(self) -> Dict[str, torch.Tensor]:  # type: ignore[override]
        return self._optimizer.params

    @property
    def state(self) -> Dict[torch.Tensor, Any]:  # type: ignore[override]
        return self._optimizer.state

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def step(self, closure: Any = None) -> Any:  # noqa: ANN401
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def save_param_groups(self, save: bool) -> None:
        self._optimizer.save_param_groups(save)

    def init_state(self, sparse_grad_parameter_names: Set[str] | None = None) -> None:
        self._optimizer.init_state(sparse_grad_parameter_names)


def in_backward_optimizer_filter(
    named_parameters: Iterable[Tuple[str, nn.Parameter]], include: bool = False
) -> Iterable[Tuple[str, nn.Parameter]]:
    """Parameters updated by a fused (in-backward) optimizer, or (default) all the others."""
    for name, param in named_parameters:
        if bool(getattr(param, "_in_backward_optimizers", False)) == include:
            yield name, param
