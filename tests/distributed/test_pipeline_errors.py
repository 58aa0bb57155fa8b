"""After an error on batch i, the train pipeline goes on with batch i+1.

Rank 1's batches at the bad positions carry an id past its table; both ranks run `progress`
in a loop that logs errors and goes on. Every rank must raise once per bad batch (at that
batch's step, not the one before), run every good batch exactly once, and end with the
weights of a plain loop over the good batches only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

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
    state_diff,
)

from recshard.distributed.model_parallel import get_unwrapped_module
from recshard.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

WS = 2
STEPS = 7


def _poisoned(step: int, rank: int, ws: int, bad: Tuple[int, ...]) -> Batch:
    batch = batch_for(step, rank, ws)
    if rank == 1 and step in bad:
        kjt = batch.sparse_features
        values = kjt.values().clone()
        values[0] = 99
        batch.sparse_features = type(kjt).from_lengths_sync(kjt.keys(), values, kjt.lengths())
    return batch


def skip_bad_batches(rank: int, ws: int, kind: str, bad: Tuple[int, ...]) -> Dict[str, Any]:
    batches = [_poisoned(s, rank, ws, bad) for s in range(STEPS)]
    model = build(ws)
    optimizer = optimizer_for(model)
    make = TrainPipelineSparseDist if kind == "sparse_dist" else TrainPipelineBase
    pipeline = make(model, optimizer, torch.device("cpu"))
    events: List[str] = []
    iterator = iter(batches)
    for _ in range(3 * STEPS):
        try:
            _, _, index = pipeline.progress(iterator)
            events.append(str(index))
        except StopIteration:
            break
        except (ValueError, RuntimeError) as e:
            events.append(f"{type(e).__name__}: {e}")
    reference = build(ws)
    plain_loop(reference, optimizer_for(reference), [b for b in batches if b.index not in bad])
    return {"events": events, "diff": state_diff(model_state(model), model_state(reference))}


@pytest.mark.parametrize("kind", ["sparse_dist", "base"])
@pytest.mark.parametrize("bad", [(2,), (0,), (3, 4), (6,)])
def test_progress_goes_on_after_a_bad_batch(kind: str, bad: Tuple[int, ...]) -> None:
    results = run_ranks(WS, skip_bad_batches, kind, bad, timeout=120, pg_timeout_s=60)
    for rank, result in enumerate(results):
        events = result["events"]
        errors = [i for i, e in enumerate(events) if not e.isdigit()]
        assert [e for e in events if e.isdigit()] == [
            str(s) for s in range(STEPS) if s not in bad
        ], (rank, events)
        assert errors == list(bad), (rank, events)  # raised at the bad batch's own step
        for i in errors:
            want = "ValueError" if rank == 1 else "RuntimeError: rank 1 rejected its input"
            assert events[i].startswith(want) and "99" in events[i], (rank, events[i])
        assert result["diff"] == [], (rank, result["diff"])


def _raise_on_huge_dense(_module: Any, args: Tuple[torch.Tensor, ...]) -> None:
    if args[0].abs().max() > 1e8:
        raise ValueError("dense features past 1e8")


def forward_raises(rank: int, ws: int, bad: Tuple[int, ...]) -> Dict[str, Any]:
    """Every rank's forward raises on the bad batches in the dense layer that runs before the
    sharded modules, with the batch's input dist done, its lookups and output dists started
    before the forward (they must be finished, not left in flight) and the next batch's input
    dist in flight."""
    batches = [batch_for(s, rank, ws) for s in range(STEPS)]
    for batch in batches:
        if batch.index in bad:
            batch.dense_features[0, 0] = 1e9
    model = build(ws)
    pipeline = TrainPipelineSparseDist(model, optimizer_for(model), torch.device("cpu"))
    get_unwrapped_module(model).dense.register_forward_pre_hook(_raise_on_huge_dense)
    events: List[str] = []
    iterator = iter(batches)
    for _ in range(3 * STEPS):
        try:
            events.append(str(pipeline.progress(iterator)[2]))
        except StopIteration:
            break
        except ValueError as e:
            events.append(str(e))
    reference = build(ws)
    plain_loop(reference, optimizer_for(reference), [b for b in batches if b.index not in bad])
    return {"events": events, "diff": state_diff(model_state(model), model_state(reference))}


def test_forward_raising_on_every_rank_goes_on_with_the_next_batch() -> None:
    results = run_ranks(WS, forward_raises, (1, 4), timeout=120, pg_timeout_s=60)
    want = ["0", "dense features past 1e8", "2", "3", "dense features past 1e8", "5", "6"]
    assert results == [{"events": want, "diff": []}] * WS, results
