"""Key-value tables under the train pipelines: `PrefetchTrainPipelineSparseDist`,
`TrainPipelineSparseDist` and the plain loop on a key-value model give the losses and weights
of the plain loop on the same model with in-memory fused tables (2 ranks, DRAM caches of a
tenth of each shard, Zipf-like ids so rows move in and out of the caches)."""

from __future__ import annotations

import tempfile
from typing import List

import torch
from dmp_cases import make_optimizer
from kv_cases import STEPS, build, make_batch, state
from multiprocess import run_ranks
from pipeline_cases import plain_loop, run_pipeline

from recshard.distributed.train_pipeline import (
    PrefetchTrainPipelineSparseDist,
    TrainPipelineSparseDist,
)


def equivalence(rank: int, ws: int, base: str) -> List[str]:
    batches = [make_batch(step, rank) for step in range(STEPS)]
    reference = build("fused", ws, "")
    want_losses = plain_loop(
        reference, make_optimizer(reference, fused=True, adagrad=False), batches
    )
    want = state(reference)
    problems = []
    for name in ["prefetch", "sparse_dist", "plain"]:
        model = build("key_value", ws, tempfile.mkdtemp(prefix=f"{name}-{rank}-", dir=base))
        optimizer = make_optimizer(model, fused=True, adagrad=False)
        if name == "plain":
            losses = plain_loop(model, optimizer, batches)
        else:
            kind = (
                PrefetchTrainPipelineSparseDist if name == "prefetch" else TrainPipelineSparseDist
            )
            losses = run_pipeline(kind(model, optimizer, torch.device("cpu")), batches)
        if [i for _, i in losses] != [i for _, i in want_losses] or not torch.allclose(
            torch.tensor([loss for loss, _ in losses]),
            torch.tensor([loss for loss, _ in want_losses]),
            atol=1e-6,
        ):
            problems.append(f"{name}: losses {losses} != {want_losses}")
        got = state(model)
        problems += [
            f"{name}: {k} differs" for k in want if not torch.allclose(got[k], want[k], atol=1e-6)
        ]
    return problems


def test_pipelines_on_key_value_equal_plain_loop_on_fused(tmp_path) -> None:  # noqa: ANN001
    assert run_ranks(2, equivalence, str(tmp_path), timeout=300) == [[], []]
