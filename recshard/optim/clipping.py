"""Gradient clipping before a KeyedOptimizer's step (TorchRec's `GradientClippingOptimizer`).

    optimizer = GradientClippingOptimizer(dense_optimizer, GradientClipping.NORM, max_gradient=1.0)

NORM scales every gradient by `max_gradient / (total_norm + 1e-6)` when that is below 1, the
total norm taken over all the optimizer's parameters as if the model were unsharded: a
parameter whose ranks each hold a different piece (a model-parallel table on a dense kernel,
marked by the sharded module with `mark_sharded`, or one listed in `param_to_pgs` with
`enable_global_grad_clip`) adds its pieces' `|g|^p` summed over its process group (max for
the inf-norm); the others (DDP-averaged dense layers, data-parallel tables: the same gradient
on every rank) count once. So every rank computes the same norm, and replicated parameters
stay equal across ranks. VALUE clamps each gradient element to `[-max_gradient, max_gradient]`
(elementwise: sharded or not is the same). Fused tables update inside backward and have no
gradient here: clipping cannot reach them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recshard.optim.keyed import KeyedOptimizer, OptimizerWrapper

logger = logging.getLogger(__name__)

ProcessGroups = Tuple[dist.ProcessGroup | None, ...]  # None: the default group


@unique
class GradientClipping(Enum):
    NORM = "norm"
    VALUE = "value"
    NONE = "none"


@dataclass(frozen=True)
class ShardedAcross:
    """On a parameter: each rank of `pg` (None: the default group) holds a different piece."""

    pg: dist.ProcessGroup | None

    def __reduce__(self) -> Tuple[Any, Tuple[()]]:
        return _no_mark, ()  # a process group does not travel: a pickled param comes back unmarked


def _no_mark() -> None:
    return None


def mark_sharded(param: torch.Tensor, pg: dist.ProcessGroup | None) -> None:
    """Record that `param` is this rank's piece of a tensor cut across the ranks of `pg`."""
    param.sharded_across = ShardedAcross(pg)  # type: ignore[attr-defined]


def sharded_across(param: torch.Tensor) -> ShardedAcross | None:
    """The mark `mark_sharded` left on `param`, None for a replicated (or local) one."""
    return getattr(param, "sharded_across", None)


class GradientClippingOptimizer(OptimizerWrapper):
    """Clip the gradients of `optimizer`'s params, then step it (TorchRec's arguments).
    `norm_type`: a p > 0, or `"inf"` / `float("inf")`. `track_grad_norm`: keep the total norm
    of each step in `last_total_grad_norm` under VALUE / NONE too (before clipping)."""

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        clipping: GradientClipping = GradientClipping.NONE,
        max_gradient: float = 0.1,
        norm_type: float | str = 2.0,
        enable_global_grad_clip: bool = False,
        param_to_pgs: Dict[torch.nn.Parameter, List[dist.ProcessGroup]] | None = None,
        track_grad_norm: bool = False,
    ) -> None:
        super().__init__(optimizer)
        if not isinstance(clipping, GradientClipping):
            raise ValueError(
                f"GradientClippingOptimizer: clipping {clipping!r} is not a GradientClipping"
            )
        norm = float(norm_type)
        if not norm > 0:
            raise ValueError(
                f"GradientClippingOptimizer: norm_type={norm_type!r} must be > 0 or 'inf'"
            )
        if clipping != GradientClipping.NONE and not max_gradient >= 0:
            raise ValueError(f"GradientClippingOptimizer: max_gradient={max_gradient} must be >= 0")
        self._clipping = clipping
        self._max_gradient = max_gradient
        self._norm_type = norm
        self._track_grad_norm = track_grad_norm
        self._last_total_grad_norm: torch.Tensor | None = None
        self._replicated: List[torch.Tensor] = []
        self._sharded: Dict[ProcessGroups, List[torch.Tensor]] = {}
        given = param_to_pgs if enable_global_grad_clip and param_to_pgs else {}
        for group in self.param_groups:
            for param in group["params"]:
                mark = sharded_across(param)
                if given.get(param):
                    self._sharded.setdefault(tuple(given[param]), []).append(param)
                elif mark is not None:
                    self._sharded.setdefault((mark.pg,), []).append(param)
                else:
                    self._replicated.append(param)
        logger.info(
            "gradient clipping over %d sharded and %d replicated params",
            sum(len(p) for p in self._sharded.values()),
            len(self._replicated),
        )

    @property
    def last_total_grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm of the latest step (None before, or when not computed)."""
        return self._last_total_grad_norm

    def _all_params(self) -> List[torch.Tensor]:
        return self._replicated + [p for params in self._sharded.values() for p in params]

    def step(self, closure: Any = None) -> None:  # noqa: ANN401
        """Clip, then the wrapped step. Parameters still on `meta` skip the clipping."""
        self._last_total_grad_norm = None
        if any(p.device.type == "meta" for p in self._all_params()):
            self._optimizer.step(closure)
            return
        if self._clipping == GradientClipping.NORM:
            self._last_total_grad_norm = self.clip_grad_norm_()
        elif self._track_grad_norm:  # VALUE, NONE: the norm before clipping
            total, grads = self.compute_total_grad_norm()
            self._last_total_grad_norm = total if grads else None
        if self._clipping == GradientClipping.VALUE:
            for grad in _grads(self._all_params()):
                grad.clamp_(-self._max_gradient, self._max_gradient)
        self._optimizer.step(closure)

    def compute_total_grad_norm(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The total gradient norm (the same on every rank: one all-reduce per process-group
        set of sharded params) and the gradients it covers."""
        inf = self._norm_type == float("inf")
        # the params' device, also for a rank without gradients (NCCL reduces device tensors)
        device = next((p.device for p in self._all_params()), torch.device("cpu"))
        replicated = _grads(self._replicated)
        total = _norm_power(replicated, self._norm_type, device)
        grads = list(replicated)
        for pgs, params in self._sharded.items():
            sharded = _grads(params)
            part = _norm_power(sharded, self._norm_type, device)
            for pg in pgs if dist.is_initialized() else ():
                dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pg)
            total = torch.maximum(total, part) if inf else total + part
            grads += sharded
        return (total if inf else total.pow(1.0 / self._norm_type)), grads

    def clip_grad_norm_(self) -> torch.Tensor | None:
        """Scale every gradient by `max_gradient / (total norm + 1e-6)`, capped at 1; returns
        the total norm (None when no parameter has a gradient)."""
        total, grads = self.compute_total_grad_norm()
        scale = torch.clamp(self._max_gradient / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale.to(grad.device))
        return total if grads else None


def _grads(params: List[torch.Tensor]) -> List[torch.Tensor]:
    """The non-empty gradients of `params` (local pieces of DTensor gradients)."""
    grads = []
    for p in params:
        grad = p.grad
        if grad is None or grad.numel() == 0:
            continue
        grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    return grads


def _norm_power(grads: List[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """`sum |g|^p` over all elements of `grads` (the max `|g|` for the inf-norm), float32 on
    `device`; 0 for none."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float().to(device) for g in grads])
    if norm_type == float("inf"):
        return norms.max()
    return norms.pow(norm_type).sum()
