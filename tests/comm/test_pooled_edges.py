"""The pooled all-to-all's direct layout (chunks laid from shared memory, backward packed into
the ring) at its edges: world sizes 1-4, ranks with no batch, ranks with no columns, steps
where nobody has a batch, parts streamed through a ring smaller than them; the oracle is the
unsharded reference, on shared memory and gloo alike."""

from __future__ import annotations

import os
import signal
from typing import List

import pytest
import torch
import torch.distributed as dist
from comm_helpers import assert_close, reference_grads, seeded
from multiprocess import run_ranks

from recshard.comm import alltoall_pooled, transport
from recshard.comm.errors import CollectiveError

Tensors = List[torch.Tensor]

_SHAPES = {  # name -> (batch per rank, dims per rank), for 4 ranks (the first ws are used)
    "no_batch_here": ([0, 5, 0, 7], [32, 16, 48, 16]),
    "no_columns_here": ([3, 5, 2, 7], [32, 0, 48, 0]),
    "no_batch_anywhere": ([0, 0, 0, 0], [16, 32, 16, 48]),
    "streamed": ([96, 160, 64, 128], [80, 48, 112, 64]),
}


def _edges(rank: int, ws: int, shape: str) -> bool:
    """Forward and backward of `shape` three times (reused buffers, a ring that grows)."""
    batch, dims = (values[:ws] for values in _SHAPES[shape])
    blocks = [(c, a, 16) for a in range(0, max(dims), 16) for c in range(ws) if a < dims[c]]
    starts = [sum(batch[:r]) for r in range(ws)]
    inputs = [seeded(90 + r, sum(batch), dims[r]) for r in range(ws)]

    def reference(xs: Tensors) -> Tensors:
        return [
            torch.cat(
                [xs[c][starts[r] : starts[r] + batch[r], a : a + w] for c, a, w in blocks]
                or [torch.empty(batch[r], 0)],
                1,
            )
            for r in range(ws)
        ]

    expected = reference(inputs)
    weights = [seeded(9000 + r, *e.shape) for r, e in enumerate(expected)]
    for _ in range(3):
        x = inputs[rank].clone().requires_grad_()
        out = alltoall_pooled(x, batch, dims, column_blocks=blocks).wait()
        assert_close(out, expected[rank], f"{shape}: forward")
        (out * weights[rank]).sum().backward()
        grad = reference_grads(inputs, reference, weights)[rank] / ws
        assert_close(x.grad, grad, f"{shape}: backward")
    return ws == 1 or transport.uses_shared_memory(dist.group.WORLD)


@pytest.mark.parametrize("shape", sorted(_SHAPES))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "env, shm_on",
    [({transport.CAP_ENV: "0.0625"}, True), ({transport.ENV: "0"}, False)],
    ids=["shared_memory_in_pieces", "gloo"],
)
def test_pooled_edges_match_the_reference(
    env: dict, shm_on: bool, world_size: int, shape: str
) -> None:
    results = run_ranks(world_size, _edges, shape, timeout=120, env=env)
    assert results == [shm_on or world_size == 1] * world_size


def _pooled_death(rank: int, ws: int, phase: str) -> str:
    """A pooled step, then rank 2 is killed right after issuing the next forward (its peers
    are taking its part from shared memory) or before the backward (its peers are packing
    theirs into the ring): the others must raise naming it, not hang or lay a stale ring."""
    batch, dims = [96, 160, 64], [80, 48, 112]
    blocks = [(c, a, 16) for a in range(0, 112, 16) for c in range(ws) if a < dims[c]]
    x = seeded(90 + rank, sum(batch), dims[rank]).requires_grad_()
    alltoall_pooled(x, batch, dims, column_blocks=blocks).wait().sum().backward()
    try:
        pending = alltoall_pooled(x, batch, dims, column_blocks=blocks)
        if rank == 2 and phase == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        out = pending.wait()
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        out.sum().backward()
    except CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_peer_killed_mid_exchange_is_named(phase: str) -> None:
    env = {transport.CAP_ENV: "0.0625", "RECSHARD_PG_TIMEOUT_S": "600"}
    results = run_ranks(3, _pooled_death, phase, timeout=90, may_die=[2], env=env)
    assert results[2][0] == "exited"
    for message in results[:2]:
        assert "rank 2" in message and "pooled all-to-all" in message, message
