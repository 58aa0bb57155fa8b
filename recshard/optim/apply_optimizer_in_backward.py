"""`apply_optimizer_in_backward`: name the optimizer of embedding tables before sharding.

    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1})
    model = DistributedModelParallel(model, ...)

The optimizer class and kwargs are attached to each parameter (torch's
`_apply_optimizer_in_backward`, which also runs it in backward while the module is unsharded).
When a collection is sharded, `fused_params_for` turns the attached optimizer of a table's
weight into the fused kernel's settings; they win over the sharder's `fused_params`, as in
TorchRec. Mapping: `torch.optim.SGD` -> EXACT_SGD, `torch.optim.Adagrad` -> EXACT_ADAGRAD,
`RowWiseAdagrad` -> EXACT_ROWWISE_ADAGRAD, `torch.optim.Adam` -> ADAM; `lr`, `eps` and `betas`
are carried over and the class's own defaults fill the rest (torch's Adagrad eps is 1e-10).
Anything the fused update would not reproduce (SGD momentum, weight decay, lr decay, an
initial accumulator, amsgrad, maximize, another class) is an error naming the table: the
fused update is the torch optimizer's step, or the table is not sharded at all.

A table given the 'dense' compute kernel (data-parallel ones always are) ignores the attached
optimizer, as in TorchRec: its sharded weight is a plain parameter that
`in_backward_optimizer_filter` yields, for the dense optimizer to step.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable, List, Tuple, Type

import torch
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.optim import Optimizer

from recshard.optim.rowwise_adagrad import RowWiseAdagrad

# class -> (fused optimizer, kwargs carried over, kwargs that must keep their "off" value).
# The fused optimizer by its fused-params name (`recshard.lookup.fused_params.OptimType`'s
# values): recshard.optim stays off the embedding stack (pyproject's import contracts).
_OFF = {"weight_decay": 0.0, "maximize": False}
_FUSED: Dict[Type[Optimizer], Tuple[str, Tuple[str, ...], Dict[str, Any]]] = {
    torch.optim.SGD: (
        "exact_sgd",
        ("lr",),
        {**_OFF, "momentum": 0.0, "dampening": 0.0, "nesterov": False},
    ),
    torch.optim.Adagrad: (
        "exact_adagrad",
        ("lr", "eps"),
        {**_OFF, "lr_decay": 0.0, "initial_accumulator_value": 0.0},
    ),
    RowWiseAdagrad: (
        "exact_row_wise_adagrad",
        ("lr", "eps"),
        {**_OFF, "lr_decay": 0.0, "initial_accumulator_value": 0.0},
    ),
    torch.optim.Adam: ("adam", ("lr", "eps", "betas"), {**_OFF, "amsgrad": False}),
}


def apply_optimizer_in_backward(
    optimizer_class: Type[Optimizer],
    params: Iterable[torch.nn.Parameter],
    optimizer_kwargs: Dict[str, Any],
) -> None:
    """Attach `optimizer_class(**optimizer_kwargs)` to each parameter (TorchRec's signature)."""
    _apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)


def attached_optimizers(
    weight: torch.Tensor | None,
) -> List[Tuple[Type[Optimizer], Dict[str, Any]]]:
    """The (class, kwargs) of every optimizer attached to `weight`, in attach order (the
    attributes torch's `_apply_optimizer_in_backward` sets; none for a plain tensor)."""
    classes = getattr(weight, "_optimizer_classes", [])
    kwargs_list = getattr(weight, "_optimizer_kwargs", [])
    return [(c, dict(kwargs)) for c, kwargs in zip(classes, kwargs_list)]


def _class_defaults(optimizer_class: Type[Optimizer]) -> Dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(optimizer_class.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def fused_params_for(
    weight: torch.Tensor | None, fused_params: Dict[str, Any] | None, table: str
) -> Dict[str, Any]:
    """The fused params of `table`: the sharder's, overridden by the optimizer attached to
    its unsharded `weight` (if any)."""
    merged = dict(fused_params or {})
    attached = attached_optimizers(weight)
    if not attached:
        return merged
    if len(attached) != 1:
        raise ValueError(
            f"table '{table}': {len(attached)} optimizers are attached to its weight "
            f"({[c.__name__ for c, _ in attached]}); a fused table runs exactly one"
        )
    optimizer_class, given = attached[0]
    if optimizer_class not in _FUSED:
        raise ValueError(
            f"table '{table}': optimizer {optimizer_class.__module__}.{optimizer_class.__name__} "
            f"has no fused kernel; supported: {', '.join(c.__name__ for c in _FUSED)} (or use "
            "compute_kernel='dense' and any torch optimizer)"
        )
    optim, carried, off = _FUSED[optimizer_class]
    settings = {**_class_defaults(optimizer_class), **given}
    for name, value in off.items():
        if name in settings and settings[name] != value:
            raise ValueError(
                f"table '{table}': {optimizer_class.__name__} {name}={settings[name]!r} "
                f"is not run by the fused kernel (only {name}={value!r})"
            )
    merged["optimizer"] = optim
    merged["learning_rate"] = float(settings["lr"])
    if "eps" in carried:
        merged["eps"] = float(settings["eps"])
    if "betas" in carried:
        merged["beta1"], merged["beta2"] = (float(b) for b in settings["betas"])
    return merged
