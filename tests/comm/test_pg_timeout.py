"""RECSHARD_PG_TIMEOUT_S reaches the groups recshard creates; a default group left at torch's
30-minute timeout is named once, with the variable that fixes it."""

from __future__ import annotations

import logging
from typing import Dict, List

import torch
import torch.distributed as dist
from dmp_cases import TinyDLRM
from multiprocess import run_ranks

from recshard.comm.pg import intra_and_cross_node_pg
from recshard.distributed import DistributedModelParallel
from recshard.distributed.train_pipeline import TrainPipelineSparseDist
from recshard.distributed.train_pipeline.utils import gloo_twin


def _timeout_s(pg: dist.ProcessGroup) -> float:
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def created_groups(rank: int, ws: int) -> Dict[str, float]:
    """Groups made with RECSHARD_PG_TIMEOUT_S=7 while the default group has 60 s."""
    intra, cross = intra_and_cross_node_pg(dist.group.WORLD, 1)
    twin = gloo_twin(dist.group.WORLD)  # the batch vote's group when the model's is NCCL
    return {
        "world": _timeout_s(dist.group.WORLD),
        "intra": _timeout_s(intra),
        "cross": _timeout_s(cross),
        "vote": _timeout_s(twin),
    }


def test_recshard_groups_follow_the_variable() -> None:
    got = run_ranks(
        2, created_groups, timeout=60, pg_timeout_s=60, env={"RECSHARD_PG_TIMEOUT_S": "7"}
    )[0]
    assert got == {"world": 60.0, "intra": 7.0, "cross": 7.0, "vote": 7.0}, got


def warnings_seen(rank: int, ws: int) -> List[str]:
    records: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("recshard").addHandler(handler)
    for _ in range(2):
        model = DistributedModelParallel(TinyDLRM())
        TrainPipelineSparseDist(model, None, torch.device("cpu"))
    return [r for r in records if "timeout" in r]


def test_default_group_with_torch_default_timeout_is_named_once() -> None:
    for messages in run_ranks(2, warnings_seen, timeout=90, pg_timeout_s=1800):
        assert len(messages) == 1, messages
        assert "RECSHARD_PG_TIMEOUT_S" in messages[0] and "30 minutes" in messages[0]
        assert "init_process_group(..., timeout=recshard.comm.pg.pg_timeout())" in messages[0]
    assert run_ranks(2, warnings_seen, timeout=90, pg_timeout_s=60) == [[], []]
