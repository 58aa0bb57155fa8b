"""TrainPipelineSparseDist equals the plain loop; it finds pipelineable modules by fx tracing,
runs the others unpipelined, drains at the end, stops uneven ranks together, and evaluates.

Reference: the same DMP model (same seed, same plan) trained by `zero_grad / forward / backward /
step` over the same batches on the same ranks (gloo, world size 2).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

import pytest
import torch
from multiprocess import run_ranks
from pipeline_cases import (
    Batch,
    batch_for,
    build,
    model_state,
    optimizer_for,
    plain_loop,
    run_pipeline,
    state_diff,
)
from torch import nn

from recshard.distributed.train_pipeline import (
    EvalPipelineSparseDist,
    TrainPipelineBase,
    TrainPipelineSparseDist,
    trace_sharded_inputs,
)
from recshard.types import ShardedModule

WS = 2


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _capture() -> _Capture:
    handler = _Capture()
    logging.getLogger("recshard.distributed.train_pipeline").addHandler(handler)
    return handler


def _compare(
    rank: int, ws: int, make_pipeline: Any, batches: List[Batch], computed: bool = False
) -> List[str]:
    """Pipeline vs plain loop from the same weights: losses, batch order, final weights."""
    reference = build(ws, computed)
    want = plain_loop(reference, optimizer_for(reference), batches)
    model = build(ws, computed)
    got = run_pipeline(make_pipeline(model, optimizer_for(model)), batches)
    problems = []
    if [i for _, i in got] != [b.index for b in batches]:
        problems.append(f"batches run {[i for _, i in got]} != {[b.index for b in batches]}")
    if not torch.allclose(
        torch.tensor([x for x, _ in got]), torch.tensor([x for x, _ in want]), atol=1e-6
    ):
        problems.append(f"losses {got} != {want}")
    return problems + state_diff(model_state(model), model_state(reference))


def equivalence(rank: int, ws: int) -> Dict[str, List[str]]:
    problems: Dict[str, List[str]] = {}
    sparse_dist = lambda m, o: TrainPipelineSparseDist(m, o, torch.device("cpu"))  # noqa: E731
    for steps in (1, 2, 3, 7):
        batches = [batch_for(s, rank, ws) for s in range(steps)]
        problems[f"sparse_dist/{steps}"] = _compare(rank, ws, sparse_dist, batches)
    base = lambda m, o: TrainPipelineBase(m, o, torch.device("cpu"))  # noqa: E731
    problems["base/3"] = _compare(rank, ws, base, [batch_for(s, rank, ws) for s in range(3)])

    model = build(ws)
    pipeline = TrainPipelineSparseDist(model, optimizer_for(model), torch.device("cpu"))
    problems["pipelined modules"] = (
        []
        if pipeline.pipelined_modules == ["user", "item"]
        else [f"pipelined {pipeline.pipelined_modules}, unpipelined {pipeline.unpipelined_modules}"]
    )
    iterator = iter([batch_for(s, rank, ws) for s in range(2)])
    run = [pipeline.progress(iterator)[2] for _ in range(2)]
    for _ in range(2):  # stays stopped
        with pytest.raises(StopIteration):
            pipeline.progress(iterator)
    # a new iterator starts over; the model still works outside the pipeline
    run += [pipeline.progress(iter([batch_for(5, rank, ws)]))[2]]
    loss, _ = model(batch_for(6, rank, ws))
    loss.backward()
    problems["restart"] = [] if run == [0, 1, 5] else [f"ran {run}"]
    problems["schedule"] = schedule(rank, ws)
    return {k: v for k, v in problems.items() if v}


def schedule(rank: int, ws: int) -> List[str]:
    """Batch i+1's splits exchange starts before forward(i), its tensors exchange between
    forward(i) and backward(i); the forward takes the pre-started dist (no input dist inside)."""
    model = build(ws)
    batches = [batch_for(s, rank, ws) for s in range(4)]
    owner = {b.sparse_features.values().data_ptr(): b.index for b in batches}
    events: List[str] = []
    user = model.module.user
    original = user.input_dist

    def recording(ctx: Any, features: Any) -> Any:
        index = owner.get(features.values().data_ptr(), "?")
        events.append(f"dist{index}")
        request = original(ctx, features)
        first_wait = request.wait
        request.wait = lambda: (events.append(f"tensors{index}"), first_wait())[1]
        return request

    user.input_dist = recording
    model.module.dense.register_forward_pre_hook(lambda *_: events.append("fwd"))
    model.module.dense.register_full_backward_hook(lambda *_: events.append("bwd"))
    run_pipeline(TrainPipelineSparseDist(model, optimizer_for(model), "cpu"), batches)
    want = ["dist0", "tensors0"]
    for i in range(1, 4):
        want += [f"dist{i}", "fwd", f"tensors{i}", "bwd"]
    want += ["fwd", "bwd"]
    return [] if events == want else [f"events {events} != {want}"]


def test_pipeline_matches_plain_loop() -> None:
    results = run_ranks(WS, equivalence, timeout=200)
    assert results == [{}, {}], results


def computed_input(rank: int, ws: int) -> Dict[str, Any]:
    capture = _capture()
    batches = [batch_for(s, rank, ws) for s in range(4)]
    pipelines: List[TrainPipelineSparseDist] = []

    def make(m: nn.Module, o: Any) -> TrainPipelineSparseDist:
        pipelines.append(TrainPipelineSparseDist(m, o, torch.device("cpu")))
        return pipelines[-1]

    problems = _compare(rank, ws, make, batches, computed=True)
    model = build(ws, computed_item_ids=True)
    try:
        TrainPipelineSparseDist(model, optimizer_for(model), torch.device("cpu"), strict=True)
        strict_error = ""
    except ValueError as e:
        strict_error = str(e)
    return {
        "problems": problems,
        "pipelined": pipelines[0].pipelined_modules,
        "unpipelined": sorted(pipelines[0].unpipelined_modules),
        "warnings": capture.messages,
        "strict_error": strict_error,
    }


def test_computed_input_runs_unpipelined_with_a_warning() -> None:
    for result in run_ranks(WS, computed_input, timeout=200):
        assert result["problems"] == []
        assert result["pipelined"] == ["user"] and result["unpipelined"] == ["item"]
        warned = [m for m in result["warnings"] if "'item' will NOT be pipelined" in m]
        assert len(warned) == 1 and "remap_ids" in warned[0], result["warnings"]
        assert "'item' cannot be pipelined" in result["strict_error"]


def uneven(rank: int, ws: int) -> Dict[str, Any]:
    """Rank 0 has 5 batches, rank 1 has 3: both run 3 steps and stop."""
    capture = _capture()
    counts = [5, 3]
    batches = [batch_for(s, rank, ws) for s in range(counts[rank])]
    out: Dict[str, Any] = {}
    model = build(ws)
    out["sparse_dist"] = run_pipeline(
        TrainPipelineSparseDist(model, optimizer_for(model), "cpu"), batches
    )
    reference = build(ws)
    out["plain"] = plain_loop(reference, optimizer_for(reference), batches[:3])
    out["state"] = state_diff(model_state(model), model_state(reference))
    model = build(ws)
    out["base"] = run_pipeline(TrainPipelineBase(model, optimizer_for(model), "cpu"), batches)
    model = build(ws)
    out["drop"] = run_pipeline(
        TrainPipelineSparseDist(model, optimizer_for(model), "cpu", execute_all_batches=False),
        batches,
    )
    model = build(ws)  # the same, with 5 batches on both ranks
    out["drop_even"] = run_pipeline(
        TrainPipelineSparseDist(model, optimizer_for(model), "cpu", execute_all_batches=False),
        [batch_for(s, rank, ws) for s in range(5)],
    )
    out["warnings"] = capture.messages
    return out


def test_uneven_batch_counts_stop_every_rank_at_the_same_step() -> None:
    results = run_ranks(WS, uneven, timeout=120)
    for rank, result in enumerate(results):
        assert [i for _, i in result["sparse_dist"]] == [0, 1, 2]
        assert result["sparse_dist"] == result["plain"]
        assert result["state"] == []
        assert [i for _, i in result["base"]] == [0, 1, 2]
        # execute_all_batches=False stops when the first rank's iterator ends (fetch of batch 3,
        # in step 1), dropping the batches in flight: as TorchRec, N batches give N - 2 steps
        assert [i for _, i in result["drop"]] == [0]
        assert [i for _, i in result["drop_even"]] == [0, 1, 2]
        if rank == 0:  # only the rank that had more data says it stops early
            assert any("another rank has run out of data" in m for m in result["warnings"])
        else:
            assert result["warnings"] == []


def bad_input(rank: int, ws: int) -> str:
    """Rank 1's batch 2 has an id past its table: every rank raises, none hangs."""
    batches = [batch_for(s, rank, ws) for s in range(4)]
    if rank == 1:
        kjt = batches[2].sparse_features
        values = kjt.values().clone()
        values[0] = 99
        batches[2].sparse_features = type(kjt).from_lengths_sync(kjt.keys(), values, kjt.lengths())
    model = build(ws)
    try:
        run_pipeline(TrainPipelineSparseDist(model, optimizer_for(model), "cpu"), batches)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_bad_input_on_one_rank_stops_every_rank() -> None:
    errors = run_ranks(WS, bad_input, timeout=60)
    assert errors[1].startswith("ValueError") and "99" in errors[1], errors
    assert errors[0].startswith("RuntimeError: rank 1 rejected its input"), errors


def evaluation(rank: int, ws: int) -> List[str]:
    """eval() through both pipelines gives the plain no_grad forward and changes no weight;
    switching back to train() continues training like the plain loop."""
    problems = []
    batches = [batch_for(s, rank, ws) for s in range(3)]
    reference = build(ws)
    reference.eval()
    with torch.no_grad():
        want = [reference(b)[1][1] for b in batches]
    model = build(ws)
    before = model_state(model)
    train_pipeline = TrainPipelineSparseDist(model, optimizer_for(model), "cpu")
    eval_pipeline = EvalPipelineSparseDist(model, None, "cpu")
    for name, pipeline in (
        ("train pipeline in eval()", train_pipeline),
        ("eval pipeline", eval_pipeline),
    ):
        model.eval()
        iterator = iter(batches)
        got = [pipeline.progress(iterator)[1] for _ in batches]
        with pytest.raises(StopIteration):
            pipeline.progress(iterator)
        if not all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want)):
            problems.append(f"{name}: logits {got} != {want}")
        if any(g.requires_grad for g in got):
            problems.append(f"{name}: eval output requires grad")
    problems += state_diff(model_state(model), before)
    model.train()
    reference.train()
    ref_losses = plain_loop(reference, optimizer_for(reference), batches)
    losses = run_pipeline(train_pipeline, batches)
    if losses != ref_losses:
        problems.append(f"training after eval: {losses} != {ref_losses}")
    return problems + state_diff(model_state(model), model_state(reference))


def test_eval_mode_and_eval_pipeline() -> None:
    assert run_ranks(WS, evaluation, timeout=120) == [[], []]


# ----------------------------------------------------------------------------- tracing, one process


class _FakeSharded(ShardedModule):
    def input_dist(self, ctx: Any, *inputs: Any) -> Any:
        raise NotImplementedError

    def compute(self, ctx: Any, dist_input: Any) -> Any:
        raise NotImplementedError

    def output_dist(self, ctx: Any, output: Any) -> Any:
        raise NotImplementedError


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = _FakeSharded()
        self.mlp = nn.Linear(2, 2)

    def forward(self, features: Any) -> Any:
        return self.mlp(self.ebc(features))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.by_item = _FakeSharded()
        self.by_get = _FakeSharded()
        self.tower = _Tower()
        self.computed = _FakeSharded()
        self.twice = _FakeSharded()
        self.unused = _FakeSharded()
        self.dense = nn.Sequential(nn.Linear(2, 2), nn.ReLU())

    def forward(self, batch: Any) -> Any:
        x = self.by_item(batch["idlist"]) + self.by_get(features=batch.extra.get("user"), scale=2)
        x = x + self.tower(batch.sparse[0]) + self.computed(batch["idlist"] + 1)
        x = x + self.twice(batch.a) + self.twice(batch.a)
        return self.dense(x)


def test_tracing_finds_batch_selections_and_rejects_computed_inputs() -> None:
    found = trace_sharded_inputs(_Model())
    assert {
        s.name: ([str(a) for a in s.args], {k: str(a) for k, a in s.kwargs.items()})
        for s in found.pipelined
    } == {
        "by_item": (["batch['idlist']"], {}),
        "by_get": ([], {"features": "batch.extra.get('user')", "scale": "2"}),
        "tower.ebc": (["batch.sparse[0]"], {}),
    }
    assert sorted(found.unpipelined) == ["computed", "twice", "unused"]
    assert "computed inside the model" in found.unpipelined["computed"]
    assert "2 times" in found.unpipelined["twice"]

    class Batchish:
        extra = {"user": "u"}
        sparse = ["s0"]

        def __getitem__(self, key: str) -> str:
            return f"item {key}"

    spec = {s.name: s for s in found.pipelined}
    assert spec["by_get"].inputs(Batchish()) == ([], {"features": "u", "scale": 2})
    assert spec["tower.ebc"].inputs(Batchish()) == (["s0"], {})
    assert spec["by_item"].inputs(Batchish()) == (["item idlist"], {})


def test_untraceable_model_raises_a_clear_error() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = _FakeSharded()

        def forward(self, batch: Any) -> Any:
            if batch.flag:  # control flow on the batch: fx cannot trace it
                return self.ebc(batch.sparse)
            return None

    with pytest.raises(RuntimeError, match="torch.fx could not trace Branchy.forward"):
        trace_sharded_inputs(Branchy())


def test_model_without_sharded_modules_traces_to_nothing() -> None:
    found = trace_sharded_inputs(nn.Sequential(nn.Linear(2, 2)))
    assert found.pipelined == [] and found.unpipelined == {}
