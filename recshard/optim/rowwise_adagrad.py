"""RowWiseAdagrad: Adagrad with one accumulator per row, the torch optimizer behind fbgemm's
EXACT_ROWWISE_ADAGRAD.

For a `[rows, D]` parameter: `sum[r] += mean(g[r]**2)`, `w[r] -= lr * g[r] / (sqrt(sum[r]) + eps)`.
Without weight decay a row whose gradient is zero is left as it is, so a dense step over a whole
table equals the fused kernel's sparse step over the rows looked up. Attach it with
`recshard.optim.apply_optimizer_in_backward(RowWiseAdagrad, ...)` to train sharded tables
with the fused row-wise kernel, or use it directly on unsharded modules.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.optim import Optimizer


class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad (TorchRec's `RowWiseAdagrad` arguments). 1-D params: one row each."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
    ) -> None:
        for name, value in (
            ("lr", lr),
            ("lr_decay", lr_decay),
            ("weight_decay", weight_decay),
            ("initial_accumulator_value", initial_accumulator_value),
            ("eps", eps),
        ):
            if value < 0.0:
                raise ValueError(f"RowWiseAdagrad: invalid {name} {value} (must be >= 0)")
        super().__init__(
            params,
            dict(
                lr=lr,
                lr_decay=lr_decay,
                weight_decay=weight_decay,
                initial_accumulator_value=initial_accumulator_value,
                eps=eps,
            ),
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    grad = grad.to_dense()
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), device="cpu")  # a host count, as torch.optim
                    rows = param.shape[0] if param.dim() > 1 else 1
                    state["sum"] = torch.full(
                        (rows,),
                        float(group["initial_accumulator_value"]),
                        dtype=param.dtype,
                        device=param.device,
                    )
                state["step"] += 1
                if group["weight_decay"]:
                    grad = grad + group["weight_decay"] * param
                rows_grad = grad.reshape(state["sum"].numel(), -1)
                state["sum"].add_(rows_grad.pow(2).mean(dim=1))
                lr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
                scale = lr / (state["sum"].sqrt() + group["eps"])
                param.sub_((scale.unsqueeze(1) * rows_grad).reshape(param.shape))
        return loss
