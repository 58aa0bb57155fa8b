"""WarmupOptimizer: TorchRec's lr schedules, the iteration in the state dict (also around a
CombinedOptimizer), bad stages, and a sharded model under warm-up equal to the unsharded one
(the scheduled lr reaches the fused tables) on 2 gloo ranks, also after a state-dict resume."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from dmp_cases import TinyDLRM, make_optimizer, train
from multiprocess import run_ranks

from recshard import checkpoint
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.optim import (
    CombinedOptimizer,
    KeyedOptimizerWrapper,
    WarmupOptimizer,
    WarmupPolicy,
    WarmupStage,
)

P = WarmupPolicy

# lr before the first step, then after each of 9 steps, base lr 0.1: printed by TorchRec 1.8's
# WarmupOptimizer for the same stages
SCHEDULES = {
    "linear_step": (
        [
            WarmupStage(P.LINEAR, max_iters=4, value=0.5),
            WarmupStage(P.STEP, max_iters=8, value=0.5, decay_iters=2),
        ],
        [0.05, 0.0625, 0.075, 0.0875, 0.1, 0.025, 0.0125, 0.0125, 0.00625, 0.1],
    ),
    "constant_poly": (
        [
            WarmupStage(P.CONSTANT, max_iters=2, value=0.3),
            WarmupStage(P.POLY, max_iters=6, value=2.0),
        ],
        [0.03, 0.03, 0.03, 0.025, 0.0111111111, 0.0027777778, 0.0, 0.1, 0.1, 0.1],
    ),
    "invsqrt": (
        [
            WarmupStage(P.LINEAR, max_iters=2, value=0.0),
            WarmupStage(P.INVSQRT, max_iters=6, lr_scale=2.0),
        ],
        [0.0, 0.05, 0.1, 0.1154700538, 0.1, 0.0894427191, 0.0816496581, 0.1, 0.1, 0.1],
    ),
    "cosine": (
        [WarmupStage(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=7, value=0.1, sgdr_period=3)],
        [0.1, 0.0775, 0.0325, 0.1, 0.0775, 0.0325, 0.1, 0.0775, 0.1, 0.1],
    ),
    "interpolate": (
        [
            WarmupStage(
                P.INTERPOLATE, max_iters=6, value=1.0, start_interpolating_iters=2, end_value=0.2
            )
        ],
        [0.14, 0.12, 0.1, 0.08, 0.06, 0.04, 0.02, 0.1, 0.1, 0.1],
    ),
}


def sgd(params: Dict[str, torch.Tensor]) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(params, lambda p: torch.optim.SGD(p, lr=1.0))


def warmup(optimizer, stages: List[WarmupStage] | None = None) -> WarmupOptimizer:
    return WarmupOptimizer(optimizer, stages or SCHEDULES["linear_step"][0], lr=0.1)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_matches_torchrec(name: str) -> None:
    stages, expected = SCHEDULES[name]
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = warmup(CombinedOptimizer([sgd({"a": a}), ("x", sgd({"b": b}))]), stages)
    seen = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(9):
        optimizer.step()
        seen.append([g["lr"] for g in optimizer.param_groups])
    assert all(len(set(lrs)) == 1 for lrs in seen)  # every group gets the scheduled lr
    assert [lrs[0] for lrs in seen] == pytest.approx(expected, abs=1e-9)


def test_user_stages_are_not_modified() -> None:
    stage = WarmupStage(P.STEP, max_iters=4, value=0.5)
    warmup(sgd({"a": torch.nn.Parameter(torch.ones(1))}), [stage])
    assert stage.decay_iters == -1  # TorchRec fills it in on the caller's object


def test_update_uses_the_scheduled_lr() -> None:
    w = torch.nn.Parameter(torch.zeros(1))
    optimizer = warmup(sgd({"w": w}))
    moves = []
    for _ in range(3):
        optimizer.zero_grad()
        w.grad = torch.ones(1)
        before = w.item()
        optimizer.step()
        moves.append(before - w.item())
    assert moves == pytest.approx([0.05, 0.0625, 0.075])


def test_state_dict_round_trip_restores_iteration_and_lr() -> None:
    """TorchRec's test: ten steps, a fresh optimizer loads the state and has the same state and
    param groups. Here around a CombinedOptimizer too, where TorchRec's state dict drops it."""

    def make() -> WarmupOptimizer:
        a = torch.nn.Parameter(torch.ones(2))
        optimizer = warmup(CombinedOptimizer([("left", sgd({"a": a}))]))
        optimizer.save_param_groups(True)
        return optimizer

    first = make()
    assert first.state_dict()["state"]["__warmup"]["warmup"].tolist() == [0, 0]
    for _ in range(6):
        first.zero_grad()
        first.step()
    saved = copy.deepcopy(first.state_dict())
    assert saved["state"]["__warmup"]["warmup"].tolist() == [6, 1]
    assert list(first.state.values())[-1]["warmup"].tolist() == [6, 1]
    assert "__warmup" in first.params

    second = make()
    second.step()
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr"] == pytest.approx(0.0125)
    assert second.state_dict()["param_groups"] == first.state_dict()["param_groups"]
    assert torch.equal(second.state_dict()["state"]["__warmup"]["warmup"], torch.tensor([6, 1]))
    for _ in range(2):
        first.step()
        second.step()
    assert second.param_groups[0]["lr"] == first.param_groups[0]["lr"] == pytest.approx(0.00625)


@pytest.mark.parametrize(
    "stages,message",
    [
        (
            [WarmupStage(max_iters=4), WarmupStage(max_iters=4)],
            "max_iters=4 must be greater than .* 4",
        ),
        ([WarmupStage(max_iters=0)], "max_iters=0"),
        ([WarmupStage(P.INVSQRT, max_iters=4)], "undefined at iteration 0"),
        ([WarmupStage(P.POLY, max_iters=4, decay_iters=2)], "decay_iters=2 < max_iters=4"),
        (
            [WarmupStage(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=4, sgdr_period=0)],
            "sgdr_period=0",
        ),
        ([WarmupStage(P.INTERPOLATE, max_iters=4, end_value=0.1)], "start_interpolating_iters"),
        (
            [WarmupStage(P.INTERPOLATE, max_iters=4, start_interpolating_iters=4, end_value=0.1)],
            "start_interpolating_iters=4 must be less than max_iters=4",
        ),
        ([WarmupStage("linear", max_iters=4)], "'linear' is not a WarmupPolicy"),
    ],
)
def test_bad_stages_name_stage_and_value(stages: List[WarmupStage], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        warmup(sgd({"a": torch.nn.Parameter(torch.ones(1))}), stages)


def test_bad_checkpoints_and_name_clash_are_errors() -> None:
    optimizer = warmup(sgd({"a": torch.nn.Parameter(torch.ones(1))}))
    with pytest.raises(ValueError, match="'__warmup.warmup' is missing"):
        optimizer.load_state_dict({"state": {}})
    with pytest.raises(ValueError, match=r"\[3, 7\]"):
        optimizer.load_state_dict({"state": {"__warmup": {"warmup": torch.tensor([3, 7])}}})
    with pytest.raises(ValueError, match="'a' is already a parameter"):
        WarmupOptimizer(sgd({"a": torch.nn.Parameter(torch.ones(1))}), [], param_name="a")


# ---------------------------------------------------------------- sharded vs unsharded

STAGES = [
    WarmupStage(P.LINEAR, max_iters=2, value=0.2),
    WarmupStage(P.STEP, max_iters=4, value=0.5),
]
LRS = [0.08, 0.24, 0.4, 0.05, 0.025]  # TorchRec 1.8's lrs for STAGES at base lr 0.4
STEPS = len(LRS)


def _sharded(rank: int, ws: int, path: str) -> Dict[str, List[float]]:
    """Fused SGD tables and DDP dense layers under one warm-up; after 2 steps a second model
    resumes from the optimizer's state dict, a third from `recshard.checkpoint`. The sharders'
    lrs are not the schedule's: it must win."""

    def build(lr: float) -> DistributedModelParallel:
        torch.manual_seed(0)
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "exact_sgd", "learning_rate": lr}
        )
        return DistributedModelParallel(TinyDLRM(), sharders=[sharder])

    model = build(0.7)
    optimizer = WarmupOptimizer(make_optimizer(model, True, False), STAGES, lr=0.4)
    first = train(model, optimizer, range(2), rank, ws)
    saved = copy.deepcopy(optimizer.state_dict())
    checkpoint.save(path, model, optimizer)
    resumed = build(0.9)
    resumed.load_state_dict(model.state_dict())
    other = WarmupOptimizer(make_optimizer(resumed, True, False), STAGES, lr=0.4)
    other.load_state_dict(saved)
    restored = build(0.9)
    third = WarmupOptimizer(make_optimizer(restored, True, False), STAGES, lr=0.4)
    checkpoint.load(path, restored, third)
    return {
        "losses": first + train(model, optimizer, range(2, STEPS), rank, ws),
        "resumed": train(resumed, other, range(2, STEPS), rank, ws),
        "restored": train(restored, third, range(2, STEPS), rank, ws),
    }


def _unsharded(lrs: List[float]) -> List[float]:
    """Plain SGD on the whole model, its lr set by hand before each step."""
    torch.manual_seed(0)
    model = TinyDLRM()
    optimizer = make_optimizer(model, False, False)
    losses = []
    for step, lr in enumerate(lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        losses += train(model, optimizer, range(step, step + 1), 0, 1)
    return losses


def test_sharded_model_under_warmup_equals_unsharded(tmp_path: Path) -> None:
    results = run_ranks(2, _sharded, str(tmp_path), timeout=300)
    want = _unsharded(LRS)
    assert abs(_unsharded([LRS[0]] * STEPS)[-1] - want[-1]) > 1e-3  # the schedule matters
    for rank, result in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(result["losses"]),
            torch.tensor(want),
            atol=1e-5,
            rtol=0,
            msg=lambda m, r=rank: f"rank {r}: {m}",
        )
        for how in ("resumed", "restored"):
            torch.testing.assert_close(
                torch.tensor(result[how]),
                torch.tensor(want[2:]),
                atol=1e-5,
                rtol=0,
                msg=lambda m, r=rank, h=how: f"rank {r} {h}: {m}",
            )
