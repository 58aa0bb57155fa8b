"""TorchRec's keyed-optimizer behaviour: param groups only when asked, init_state with
sparse gradients, live views in CombinedOptimizer, OptimizerWrapper, stray state keys."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from recshard.optim import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerWrapper,
)


def sgd(params: dict, momentum: float = 0.9) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(params, lambda p: torch.optim.SGD(p, lr=0.5, momentum=momentum))


def test_param_groups_saved_and_restored_only_when_asked() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = sgd({"w": w})
    assert set(opt.state_dict()) == {"state"}
    opt.save_param_groups(True)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["params"] == ["w"] and saved["param_groups"][0]["lr"] == 0.5
    saved["param_groups"][0]["lr"] = 0.125
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.125
    with pytest.raises(ValueError, match="has no param_groups"):
        opt.load_state_dict({"state": saved["state"]})


def test_init_state_creates_state_without_moving_weights_and_keeps_pending_grads() -> None:
    dense = torch.nn.Parameter(torch.ones(2, 3))
    sparse = torch.nn.Parameter(torch.ones(4, 2))
    pending = torch.full((2, 3), 7.0)
    dense.grad = pending
    opt = sgd({"dense": dense, "sparse": sparse})
    opt.init_state({"sparse"})
    assert set(opt.state_dict()["state"]) == {"dense", "sparse"}
    assert "momentum_buffer" in opt.state_dict()["state"]["sparse"]
    assert torch.equal(dense.detach(), torch.ones(2, 3)) and torch.equal(
        sparse.detach(), torch.ones(4, 2)
    )
    assert dense.grad is pending and sparse.grad.is_sparse
    assert opt.param_groups[0]["lr"] == 0.5


def test_non_parameter_state_key_is_rejected() -> None:
    w = torch.ones(2)
    with pytest.raises(ValueError, match="All state keys must be params"):
        KeyedOptimizer({"w": w}, {w: {}, torch.zeros(1): {}}, [{"params": [w]}])


def test_nested_and_stateful_state_round_trips() -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    w = torch.ones(2)
    counter = Counter()
    opt = KeyedOptimizer(
        {"w": w}, {w: {"nested": {"t": torch.zeros(2)}, "counter": counter}}, [{"params": [w]}]
    )
    saved = opt.state_dict()
    assert saved["state"]["w"]["counter"] == {"n": 0}
    opt.load_state_dict(
        {"state": {"w": {"nested": {"t": torch.tensor([1.0, 2.0])}, "counter": {"n": 3}}}}
    )
    assert counter.n == 3 and opt.state[w]["nested"]["t"].tolist() == [1.0, 2.0]


def test_combined_views_are_live_and_prefixed() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt_a = KeyedOptimizerWrapper({"a": a}, lambda p: torch.optim.Adam(p, lr=0.1))
    combined = CombinedOptimizer([("left", opt_a), sgd({"b": b})])
    assert list(combined.params) == ["left.a", "b"]
    assert combined.state_dict()["state"] == {}
    (a.sum() + b.sum()).backward()
    combined.step()
    assert set(combined.state_dict()["state"]) == {"left.a", "b"}  # created lazily by the step
    combined.param_groups[0]["lr"] = 0.01
    assert opt_a.param_groups[0]["lr"] == 0.01
    combined.save_param_groups(True)
    assert [g["params"] for g in combined.state_dict()["param_groups"]] == [["left.a"], ["b"]]


def test_optimizer_wrapper_delegates_and_pickles() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    calls = []

    class Counting(OptimizerWrapper):
        def step(self, closure=None) -> None:  # noqa: ANN001
            calls.append(1)
            super().step(closure)

    wrapped = Counting(sgd({"w": w}))
    w.sum().backward()
    wrapped.step()
    assert calls == [1] and w.detach().tolist() == [0.5, 0.5]
    assert set(wrapped.state_dict()["state"]["w"]) == {"momentum_buffer"}
    buffer = io.BytesIO()
    torch.save(wrapped._optimizer, buffer)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=False)
    assert torch.equal(
        reloaded.state_dict()["state"]["w"]["momentum_buffer"],
        wrapped.state_dict()["state"]["w"]["momentum_buffer"],
    )
