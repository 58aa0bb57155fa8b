"""Reliability: a dead, raising or stuck rank stops the others with an error that names the
collective (never a hang). Checkpoints that survive a save killed half-way:
`tests/checkpoint/test_checkpoint_crashes.py`.

Distributed cases train the tiny DLRM of `dmp_cases` under `DistributedModelParallel` on two
ranks; at step 2 rank 1 dies (`os._exit`, SIGKILL), raises, or stops calling collectives.
Rank 0 must raise on its own, within the process-group timeout plus a margin, and the
harness must report rank 0's error text (not its own timeout).

"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import List

import pytest
import torch
from dmp_cases import batch_for, make_optimizer, table_wise_dmp
from multiprocess import RankError, run_ranks

from recshard.comm.errors import CollectiveError, describe_collective
from recshard.comm.pg import pg_timeout
from recshard.distributed.model_parallel import get_unwrapped_module

PG_TIMEOUT_S = 20.0
FAILING_STEP = 2

# --------------------------------------------------------------------------- dying ranks


def _fail_rank_1(how: str, stage: str, hang_s: float) -> None:
    """Rank 1's misbehaviour `how` if it is due at `stage` of the failing step."""
    due = {
        "exit_in_output_dist": "output_dist",
        "hang_in_output_dist": "output_dist",
        "sigkill_before_backward": "backward",
        "exit_between_steps": "start",
        "raise_between_steps": "start",
    }[how]
    if stage != due:
        return
    if how == "exit_in_output_dist":
        os._exit(1)
    if how == "hang_in_output_dist":
        time.sleep(hang_s)
        raise RuntimeError("rank 1 woke up")
    if how == "sigkill_before_backward":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit_between_steps":
        os._exit(1)
    raise ValueError("rank 1 gave up between steps")


def _train_until_rank_1_fails(rank: int, ws: int, how: str, hang_s: float) -> None:
    model = table_wise_dmp(ws)
    optimizer = make_optimizer(model, fused=True, adagrad=False)
    sharded = get_unwrapped_module(model).ebc
    if rank == 1:
        output_dist = sharded.output_dist

        def failing_output_dist(ctx, output):  # noqa: ANN001, ANN202
            if step == FAILING_STEP:
                _fail_rank_1(how, "output_dist", hang_s)
            return output_dist(ctx, output)

        sharded.output_dist = failing_output_dist
    start = time.monotonic()
    for step in range(FAILING_STEP + 2):
        if step == FAILING_STEP:
            start = time.monotonic()
            if rank == 1:
                _fail_rank_1(how, "start", hang_s)
        try:
            dense, kjt, labels = batch_for(step, rank, ws)
            optimizer.zero_grad()
            loss = model(dense, kjt, labels)
            if rank == 1 and step == FAILING_STEP:
                _fail_rank_1(how, "backward", hang_s)
            loss.backward()
            optimizer.step()
        except Exception as e:
            raise RuntimeError(
                f"rank {rank} raised at step {step} after "
                f"{time.monotonic() - start:.1f}s: {type(e).__name__}: {e}"
            ) from e
    raise AssertionError(f"rank {rank} finished every step although rank 1 failed")


def _rank_0_error(how: str, pg_timeout_s: float = PG_TIMEOUT_S, hang_s: float = 0.0) -> str:
    with pytest.raises(RankError) as info:  # a harness TimeoutError would fail here
        run_ranks(2, _train_until_rank_1_fails, how, hang_s, timeout=120, pg_timeout_s=pg_timeout_s)
    text = info.value.rank_text(0)
    match = re.search(r"rank 0 raised at step (\d+) after ([\d.]+)s: (\w+): (.*)", text)
    assert match, f"rank 0 did not raise on its own:\n{text}"
    assert int(match.group(1)) == FAILING_STEP, text
    if hang_s == 0.0:  # the peer died or raised: rank 0 learns it at once, not at the timeout
        assert "process-group timeout ran out" not in text, text
    return text


def test_rank_killed_in_forward_output_dist_names_the_collective() -> None:
    text = _rank_0_error("exit_in_output_dist")
    assert "CollectiveError: pooled all-to-all (forward) failed on rank 0 of 2" in text, text


def test_rank_killed_before_backward_names_the_collective() -> None:
    text = _rank_0_error("sigkill_before_backward")
    # The pooled all-to-all's transpose is waited inside autograd, before DDP's all-reduce
    # of the dense gradients is waited at the end of backward.
    assert "CollectiveError: pooled all-to-all (backward) failed on rank 0 of 2" in text, text


def test_rank_killed_between_steps_stops_the_other() -> None:
    text = _rank_0_error("exit_between_steps")  # an error within the timeout, not a hang
    assert "KJT all-to-all splits (forward) failed on rank 0 of 2" in text, text


def test_rank_raising_between_steps_stops_the_other() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(
            2,
            _train_until_rank_1_fails,
            "raise_between_steps",
            0.0,
            timeout=120,
            pg_timeout_s=PG_TIMEOUT_S,
        )
    assert "ValueError: rank 1 gave up between steps" in info.value.rank_text(1)
    text = info.value.rank_text(0)
    assert re.search(r"rank 0 raised at step 2 after [\d.]+s", text), text
    assert "process-group timeout ran out" not in text, text


def test_stuck_rank_times_out_with_the_collective_name() -> None:
    """Rank 1 stops calling collectives (alive, so no connection closes): rank 0 fails at the
    process-group timeout, saying which collective timed out and what sets the timeout."""
    timeout_s = 3.0
    text = _rank_0_error("hang_in_output_dist", pg_timeout_s=timeout_s, hang_s=timeout_s + 3)
    assert "CollectiveError: pooled all-to-all (forward) failed on rank 0 of 2" in text, text
    assert "process-group timeout ran out" in text, text


def test_collective_names_and_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert describe_collective("alltoall_pooled") == ("pooled all-to-all", "forward")
    assert describe_collective("alltoall_pooled_bwd") == ("pooled all-to-all", "backward")
    assert describe_collective("reduce_scatter_v_pooled_bwd") == (
        "pooled reduce-scatter-v",
        "backward",
    )
    assert describe_collective("kjt_all_to_all_values") == ("KJT all-to-all values", "forward")
    assert describe_collective("my_op") == ("my op", "forward")
    assert issubclass(CollectiveError, RuntimeError)
    monkeypatch.setenv("RECSHARD_PG_TIMEOUT_S", "12.5")
    assert pg_timeout().total_seconds() == 12.5  # read at call time, not import time
    monkeypatch.setenv("RECSHARD_PG_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="RECSHARD_PG_TIMEOUT_S"):
        pg_timeout()
    monkeypatch.delenv("RECSHARD_PG_TIMEOUT_S")
    assert pg_timeout().total_seconds() == 300


def _subgroup_timeouts(rank: int, ws: int) -> List[float]:
    from recshard.comm.pg import intra_and_cross_node_pg

    intra, cross = intra_and_cross_node_pg(torch.distributed.group.WORLD, 1)
    return [
        pg_timeout(torch.distributed.group.WORLD).total_seconds(),
        pg_timeout(intra).total_seconds(),
        pg_timeout(cross).total_seconds(),
    ]


def test_subgroups_inherit_the_process_group_timeout() -> None:
    """Table-row-wise sub-groups use the parent's timeout (they used a 300 s default fixed
    at import time, so a dead rank inside a node exchange waited 5 minutes)."""
    assert run_ranks(2, _subgroup_timeouts, timeout=60, pg_timeout_s=17)[0] == [17.0] * 3
