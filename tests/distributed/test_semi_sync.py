"""TrainPipelineSemiSync equals a plain loop that applies the same staleness (batch i+1's
embeddings looked up before batch i's sparse update), across real gloo processes; before
`start_batch` it equals the plain loop; its schedule runs batch i+1's lookup between batch i's
forward and backward; eval, gradient stashing, rejected batches and uneven data behave.

Reference: `pipeline_cases.semi_sync_loop` on the same DMP model (same seed, same plan: a
table-wise, b row-wise, c table-wise on the last rank) over the same batches and ranks.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from multiprocess import run_ranks
from pipeline_cases import (
    batch_for,
    build,
    model_state,
    optimizer_for,
    plain_loop,
    run_pipeline,
    semi_sync_loop,
    state_diff,
)

from recshard.distributed import TrainPipelineSemiSync


def _pipeline(model: Any, **kwargs: Any) -> TrainPipelineSemiSync:
    return TrainPipelineSemiSync(model, optimizer_for(model), torch.device("cpu"), **kwargs)


def _compare(got: List[Any], want: List[Any], model: Any, reference: Any) -> List[str]:
    problems = []
    if [i for _, i in got] != [i for _, i in want]:
        problems.append(f"batches run {[i for _, i in got]} != {[i for _, i in want]}")
    elif not torch.allclose(
        torch.tensor([x for x, _ in got]), torch.tensor([x for x, _ in want]), atol=1e-6, rtol=0
    ):
        problems.append(f"losses {got} != {want}")
    return problems + state_diff(model_state(model), model_state(reference))


def equivalence(rank: int, ws: int, step_counts: List[int]) -> Dict[str, List[str]]:
    problems: Dict[str, List[str]] = {}
    for steps in step_counts:
        batches = [batch_for(s, rank, ws) for s in range(steps)]
        for start_batch in sorted({0, 2}):
            reference = build(ws)
            want = semi_sync_loop(reference, optimizer_for(reference), batches, start_batch)
            model = build(ws)
            got = run_pipeline(_pipeline(model, start_batch=start_batch), batches)
            problems[f"semi_sync/{steps}/start {start_batch}"] = _compare(
                got, want, model, reference
            )
    # the staleness is real: from the second step on the semi-sync losses leave the plain loop's
    batches = [batch_for(s, rank, ws) for s in range(5)]
    plain_model = build(ws)
    plain = plain_loop(plain_model, optimizer_for(plain_model), batches)
    stale_model = build(ws)
    stale = run_pipeline(_pipeline(stale_model, start_batch=0), batches)
    same = [abs(a - b) < 1e-6 for (a, _), (b, _) in zip(stale, plain)]
    problems["stale differs from plain"] = (
        [] if same[0] and not all(same[1:]) else [f"stale {stale} vs plain {plain}"]
    )
    # default start_batch (900): synchronous, the plain loop exactly
    model = build(ws)
    got = run_pipeline(_pipeline(model), batches)
    problems["synchronous before start_batch"] = _compare(got, plain, model, plain_model)
    return {k: v for k, v in problems.items() if v}


def test_semi_sync_matches_its_stale_reference_ws2() -> None:
    results = run_ranks(2, equivalence, [1, 2, 3, 4, 7], timeout=300)
    assert results == [{}, {}], results


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 3, 4])
def test_semi_sync_matches_its_stale_reference_other_world_sizes(ws: int) -> None:
    results = run_ranks(ws, equivalence, [3, 6], timeout=400)
    assert results == [{}] * ws, results


def schedule(rank: int, ws: int) -> List[str]:
    """Per step i: forward(i), then lookup(i+1), then the dense backward of i, then batch i+3's
    tensors exchange (issued in the embedding backward, after the gradients' all-to-all)."""
    model = build(ws)
    batches = [batch_for(s, rank, ws) for s in range(6)]
    owner = {b.sparse_features.values().data_ptr(): b.index for b in batches}
    events: List[str] = []
    user = model.module.user
    original_input_dist, original_compute = user.input_dist, user.compute_and_output_dist

    def input_dist(ctx: Any, features: Any) -> Any:
        index = owner.get(features.values().data_ptr(), "?")
        request = original_input_dist(ctx, features)
        first_wait = request.wait
        request.wait = lambda: (events.append(f"tensors{index}"), first_wait())[1]
        return request

    def compute_and_output_dist(ctx: Any, data: Any) -> Any:
        events.append("lookup")
        return original_compute(ctx, data)

    user.input_dist, user.compute_and_output_dist = input_dist, compute_and_output_dist
    model.module.dense.register_forward_pre_hook(lambda *_: events.append("fwd"))
    model.module.dense.register_full_backward_hook(lambda *_: events.append("bwd"))
    run_pipeline(_pipeline(model, start_batch=0), batches)
    want = ["tensors0", "lookup", "tensors1", "tensors2"]
    for i in range(6):
        want += ["fwd"] + (["lookup"] if i + 1 < 6 else []) + ["bwd"]
        want += [f"tensors{i + 3}"] if i + 3 < 6 else []
    return [] if events == want else [f"events {events} != {want}"]


def test_semi_sync_schedule() -> None:
    assert run_ranks(2, schedule, timeout=120) == [[], []]


def variants(rank: int, ws: int) -> Dict[str, List[str]]:
    """stash_gradients, custom_model_fwd, a data-parallel table, eval mode, uneven data."""
    problems: Dict[str, List[str]] = {}
    batches = [batch_for(s, rank, ws) for s in range(5)]
    reference = build(ws)
    want = semi_sync_loop(reference, optimizer_for(reference), batches, 1, stash_gradients=True)
    model = build(ws)
    got = run_pipeline(_pipeline(model, start_batch=1, stash_gradients=True), batches)
    problems["stash_gradients"] = _compare(got, want, model, reference)

    reference = build(ws)
    want = semi_sync_loop(reference, optimizer_for(reference), batches)
    model = build(ws)
    calls: List[int] = []

    def custom(batch: Any) -> Any:
        calls.append(batch.index)
        return model(batch)

    got = run_pipeline(_pipeline(model, start_batch=0, custom_model_fwd=custom), batches)
    problems["custom_model_fwd"] = _compare(got, want, model, reference)
    if calls != [0, 1, 2, 3, 4]:
        problems["custom_model_fwd"].append(f"custom forward called for {calls}")

    reference = build(ws, data_parallel_a=True)
    want = semi_sync_loop(reference, optimizer_for(reference), batches)
    model = build(ws, data_parallel_a=True)
    got = run_pipeline(_pipeline(model, start_batch=0), batches)
    problems["data-parallel table"] = _compare(got, want, model, reference)

    model = build(ws)
    model.eval()
    with torch.no_grad():
        logits = [model(b)[1][1] for b in batches]
    before = model_state(model)
    iterator, pipeline = iter(batches), _pipeline(model, start_batch=0)
    got_logits = [pipeline.progress(iterator)[1] for _ in batches]
    if not all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got_logits, logits)):
        problems["eval"] = [f"logits {got_logits} != {logits}"]
    problems["eval weights"] = state_diff(model_state(model), before)

    counts = [5, 3] if ws == 2 else [5] * ws  # rank 1 runs out first: every rank stops at 3
    mine = batches[: counts[rank]]
    reference = build(ws)
    want = semi_sync_loop(reference, optimizer_for(reference), batches[: min(counts)])
    model = build(ws)
    got = run_pipeline(_pipeline(model, start_batch=0), mine)
    problems["uneven"] = _compare(got, want, model, reference)
    return {k: v for k, v in problems.items() if v}


def test_semi_sync_variants() -> None:
    assert run_ranks(2, variants, timeout=300) == [{}, {}]


def bad_input(rank: int, ws: int) -> Dict[str, Any]:
    """Rank 1's batch 2 has an id past its table: every rank raises at step 2 and goes on with
    batch 3 (looked up synchronously), as the stale loop over batches 0, 1, 3, 4 without it."""
    batches = [batch_for(s, rank, ws) for s in range(5)]
    if rank == 1:
        kjt = batches[2].sparse_features
        values = kjt.values().clone()
        values[0] = 99
        batches[2].sparse_features = type(kjt).from_lengths_sync(kjt.keys(), values, kjt.lengths())
    model = build(ws)
    pipeline, iterator = _pipeline(model, start_batch=0), iter(batches)
    ran, errors = [], []
    while True:
        try:
            ran.append(pipeline.progress(iterator)[2])
        except StopIteration:
            break
        except (ValueError, RuntimeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return {"ran": ran, "errors": errors}


def test_rejected_batch_raises_on_every_rank_and_training_goes_on() -> None:
    results = run_ranks(2, bad_input, timeout=120)
    for result in results:
        assert result["ran"] == [0, 1, 3, 4], result
        assert len(result["errors"]) == 1, result
    assert results[1]["errors"][0].startswith("ValueError") and "99" in results[1]["errors"][0]
    assert results[0]["errors"][0].startswith("RuntimeError: rank 1 rejected its input")
