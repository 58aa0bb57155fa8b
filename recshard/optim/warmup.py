"""Learning-rate warm-up and decay stages around a KeyedOptimizer (TorchRec's `WarmupOptimizer`).

    optimizer = WarmupOptimizer(CombinedOptimizer([model.fused_optimizer, dense]), stages=[
        WarmupStage(WarmupPolicy.LINEAR, max_iters=1000, value=0.01),   # 1% -> 100% of lr
        WarmupStage(WarmupPolicy.STEP, max_iters=5000, value=0.5, decay_iters=1000),
    ], lr=0.1)

After each `step()` the iteration counts up and every param group's `lr` becomes
`lr * multiplier(stage, iteration)`; a stage holds while `iteration <= max_iters`, then the
next one starts, and after the last the lr stays at `lr`. The multiplier reads the global
iteration, not the iteration inside the stage (as TorchRec). Fused tables take the new lr at
the next `zero_grad()` / `step()`, like a `torch.optim.lr_scheduler` edit.

The iteration and stage travel in `state_dict()["state"]["__warmup"]["warmup"]` (a long
tensor `[iteration, stage]`), present from construction on and whatever optimizer is wrapped.
That tensor is the live state and `zero_grad()` sets the lr from it again, so a loader that
copies state in place (`recshard.checkpoint.load`) resumes the schedule too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any, Dict, List, Mapping, Tuple

import torch

from recshard.optim.keyed import KeyedOptimizer, OptimizerWrapper

logger = logging.getLogger(__name__)


@unique
class WarmupPolicy(Enum):
    NONE = "none"
    LINEAR = "linear"
    CONSTANT = "constant"
    POLY = "poly"
    STEP = "step"
    INVSQRT = "inv_sqrt"
    COSINE_ANNEALING_WARM_RESTARTS = "cosine_annealing_warm_restarts"
    INTERPOLATE = "interpolate"


@dataclass
class WarmupStage:
    """One stage, in force up to iteration `max_iters`. `value`: the policy's parameter
    (LINEAR's start, CONSTANT's multiplier, POLY's exponent, STEP's factor, the cosine's floor,
    INTERPOLATE's start); `lr_scale` multiplies the result. `decay_iters` (<= 0: unset) is
    POLY's horizon (default `max_iters`) and STEP's step size (default 1); `sgdr_period` the
    cosine's restart period; INTERPOLATE goes linearly from `value` at
    `start_interpolating_iters` to `end_value` at `max_iters`."""

    policy: WarmupPolicy = WarmupPolicy.LINEAR
    max_iters: int = 1
    value: float = 1.0
    lr_scale: float = 1.0
    decay_iters: int = -1
    sgdr_period: int = 1
    start_interpolating_iters: int | None = None
    end_value: float | None = None


_FINAL_STAGE = WarmupStage(policy=WarmupPolicy.NONE, max_iters=1 << 63, value=1.0)


def warmup_stages(stages: List[WarmupStage]) -> List[WarmupStage]:
    """Checked copies of `stages` (unset `decay_iters` filled in) plus the final NONE stage;
    a `ValueError` names the stage and the value that would give no usable lr."""
    checked: List[WarmupStage] = []
    previous = 0
    for index, stage in enumerate(stages):
        what = f"warmup stage {index} ({stage.policy})"
        if not isinstance(stage.policy, WarmupPolicy):
            raise ValueError(f"warmup stage {index}: policy {stage.policy!r} is not a WarmupPolicy")
        if stage.max_iters <= previous:
            raise ValueError(
                f"{what}: max_iters={stage.max_iters} must be greater than the "
                f"previous stage's max_iters {previous}"
            )
        decay_iters = stage.decay_iters
        if decay_iters <= 0:
            decay_iters = 1 if stage.policy == WarmupPolicy.STEP else stage.max_iters
        if stage.policy == WarmupPolicy.POLY and decay_iters < stage.max_iters:
            raise ValueError(
                f"{what}: decay_iters={decay_iters} < max_iters={stage.max_iters} "
                "takes (1 - iteration / decay_iters) below 0"
            )
        if stage.policy == WarmupPolicy.INVSQRT and previous == 0:
            raise ValueError(
                f"{what}: 1 / sqrt(iteration) is undefined at iteration 0; "
                "put another stage before it"
            )
        if stage.policy == WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS and stage.sgdr_period < 1:
            raise ValueError(f"{what}: sgdr_period={stage.sgdr_period} must be at least 1")
        if stage.policy == WarmupPolicy.INTERPOLATE:
            start = stage.start_interpolating_iters
            if start is None or stage.end_value is None:
                raise ValueError(
                    f"{what}: needs start_interpolating_iters and end_value "
                    f"(got {start} and {stage.end_value})"
                )
            if start >= stage.max_iters:
                raise ValueError(
                    f"{what}: start_interpolating_iters={start} must be less than "
                    f"max_iters={stage.max_iters}"
                )
        checked.append(dataclasses.replace(stage, decay_iters=decay_iters))
        previous = stage.max_iters
    return checked + [dataclasses.replace(_FINAL_STAGE)]


def lr_multiplier(stage: WarmupStage, iteration: int) -> float:
    """The factor on the base lr at global `iteration` under `stage` (decay_iters filled in)."""
    policy = stage.policy
    if policy == WarmupPolicy.LINEAR:
        multiplier = stage.value + (1.0 - stage.value) * iteration / stage.max_iters
    elif policy == WarmupPolicy.CONSTANT:
        multiplier = stage.value
    elif policy == WarmupPolicy.POLY:
        multiplier = math.pow(1.0 - iteration / stage.decay_iters, stage.value)
    elif policy == WarmupPolicy.STEP:
        multiplier = math.pow(stage.value, iteration // stage.decay_iters)
    elif policy == WarmupPolicy.INVSQRT:
        multiplier = 1.0 / math.sqrt(iteration)
    elif policy == WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS:  # SGDR without period growth
        cosine = 0.5 * (
            1.0 + math.cos(math.pi * (iteration % stage.sgdr_period) / stage.sgdr_period)
        )
        multiplier = stage.value + (1.0 - stage.value) * cosine
    elif policy == WarmupPolicy.INTERPOLATE:
        start = float(stage.start_interpolating_iters)  # type: ignore[arg-type]
        span = stage.max_iters - start
        multiplier = (
            stage.value + (float(stage.end_value) - stage.value) * (iteration - start) / span
        )  # type: ignore[arg-type]
    else:
        multiplier = 1.0
    return multiplier * stage.lr_scale


class WarmupOptimizer(OptimizerWrapper):
    """`optimizer` with its lr set by `stages` from base `lr` (TorchRec's arguments).
    `lr_param`: the param-group key to set; `param_name`: the state key of the iteration."""

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        stages: List[WarmupStage],
        lr: float = 0.1,
        lr_param: str = "lr",
        param_name: str = "__warmup",
    ) -> None:
        super().__init__(optimizer)
        if param_name in optimizer.params:
            raise ValueError(
                f"WarmupOptimizer: param_name '{param_name}' is already a parameter "
                "of the wrapped optimizer"
            )
        self._stages = warmup_stages(stages)
        self._lr = lr
        self._lr_param = lr_param
        self._param_name = param_name
        self._warmup_param = torch.nn.Parameter(torch.empty(0, device="cpu"), requires_grad=False)
        # [iteration, stage], live: `state_dict()` hands out this tensor, so a loader that
        # copies into the state in place (recshard.checkpoint.load) moves the schedule too
        self._position = torch.zeros(2, dtype=torch.long, device="cpu")  # host schedule
        self._set_lr()  # fused tables update in the first backward, before any step()

    @property
    def params(self) -> Dict[str, torch.Tensor]:  # type: ignore[override]
        """The wrapped optimizer's params and the (empty) one the warm-up state is keyed by."""
        return {**self._optimizer.params, self._param_name: self._warmup_param}

    @property
    def state(self) -> Dict[torch.Tensor, Any]:  # type: ignore[override]
        return {**self._optimizer.state, self._warmup_param: {"warmup": self._position}}

    def _iteration_and_stage(self, position: torch.Tensor | None = None) -> Tuple[int, int]:
        """The position in the schedule (`position`, else the live one), checked: state may
        have been loaded from anywhere."""
        values = [
            int(v) for v in (self._position if position is None else position).reshape(-1).tolist()
        ]
        if len(values) != 2 or values[0] < 0 or not 0 <= values[1] < len(self._stages):
            raise ValueError(
                f"warm-up state '{self._param_name}.warmup' = {values}: needs "
                f"[iteration >= 0, stage in [0, {len(self._stages)})]"
            )
        return values[0], values[1]

    def _set_lr(self) -> None:
        iteration, stage = self._iteration_and_stage()
        lr = self._lr * lr_multiplier(self._stages[stage], iteration)
        for group in self.param_groups:
            group[self._lr_param] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The scheduled lr again (state loaded in place takes effect), then the wrapped
        zero_grad (fused tables take the lr there)."""
        self._set_lr()
        self._optimizer.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # noqa: ANN401
        """The wrapped step at the current lr, then the lr of the next iteration."""
        self._optimizer.step(closure)
        iteration, stage = self._iteration_and_stage()
        iteration += 1
        if iteration > self._stages[stage].max_iters and stage + 1 < len(self._stages):
            stage += 1
            logger.info("warm-up: %s done, %s starts", self._stages[stage - 1], self._stages[stage])
        self._position.copy_(torch.tensor([iteration, stage], device="cpu"))
        self._set_lr()

    def state_dict(self) -> Dict[str, Any]:
        own = self._optimizer.state_dict()
        return {**own, "state": {**own["state"], self._param_name: {"warmup": self._position}}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The wrapped optimizer's part, then the saved iteration and its lr."""
        saved = dict(state_dict["state"])
        entry = saved.pop(self._param_name, None)
        if entry is None or "warmup" not in entry:
            raise ValueError(
                f"warm-up state '{self._param_name}.warmup' is missing from the checkpoint"
            )
        iteration, stage = self._iteration_and_stage(torch.as_tensor(entry["warmup"], device="cpu"))
        self._optimizer.load_state_dict({**state_dict, "state": saved})
        self._position.copy_(torch.tensor([iteration, stage], device="cpu"))
        logger.info("warm-up resumed at iteration %d (stage %d)", iteration, stage)
        self._set_lr()
