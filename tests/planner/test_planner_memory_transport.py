"""The intra-host shared-memory transport in the planner's per-rank memory (issue #22, memory
target): its byte cap (`Topology.intra_host_transport_bytes`) is reserved on every rank of a
cpu host with two or more ranks and counted in `plan_stats`; the shared memory two real ranks'
transport holds after training a sharded module stays within it.
The planner reads no environment: a job without the transport says so in its `Topology`."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from multiprocess import run_ranks
from planner_cases import shard_on_world

from recshard.comm import transport
from recshard.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    StorageReservation,
    TableMeta,
    Topology,
    plan_stats,
)
from recshard.sparse import KeyedJaggedTensor
from recshard.types import ShardingPlan

ROWS, DIM, POOL, BATCH, TABLES = 4000, 64, 3, 256, 4
STEPS = 6  # several calls per call site in flight over the steps
CAP = 64 * 1024**2  # the transport's default byte cap per rank


def _tables() -> List[TableMeta]:
    return [
        TableMeta(f"t{i}", ROWS, DIM, feature_names=[f"f{i}"], pooling_factors=[float(POOL)])
        for i in range(TABLES)
    ]


def _plan(types: Dict[str, str]) -> ShardingPlan:
    constraints = {
        name: ParameterConstraints(
            sharding_types=[st], compute_kernels=["dense" if st == "data_parallel" else "fused"]
        )
        for name, st in types.items()
    }
    return EmbeddingShardingPlanner(
        Topology(2), BATCH, constraints=constraints, debug=False
    ).plan_tables(_tables())


def _held_bytes() -> int:
    """Bytes of shared memory this rank's transport holds for the module's group now."""
    return transport.held_bytes(torch.distributed.group.WORLD)


def _train(rank: int, world_size: int, plan: ShardingPlan) -> int:
    """Train the planned module `STEPS` steps on a fixed batch: `POOL` ids per bag."""
    module = shard_on_world(plan, ROWS, DIM, TABLES)
    n = TABLES * BATCH * POOL
    ids = (torch.arange(n) * 7919 + rank) % ROWS
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [f"f{i}" for i in range(TABLES)], ids, torch.full((TABLES * BATCH,), POOL), stride=BATCH
    )
    for _ in range(STEPS):
        module(kjt).values().sum().backward()
    return _held_bytes()


@pytest.mark.parametrize(
    "types",
    [
        {f"t{i}": "table_wise" for i in range(TABLES)},
        {f"t{i}": "row_wise" for i in range(TABLES)},
        {"t0": "table_wise", "t1": "column_wise", "t2": "row_wise", "t3": "row_wise"},
    ],
    ids=["table_wise", "row_wise", "mixed"],
)
def test_transport_memory_bounds_the_segments_ranks_map(types: Dict[str, str]) -> None:
    plan = _plan(types)
    estimate = [r.transport_memory for r in plan_stats(plan, _tables(), Topology(2), BATCH).ranks]
    assert estimate == [CAP, CAP]
    measured = run_ranks(2, _train, plan, timeout=240)
    for est, meas in zip(estimate, measured):
        assert 0 < meas <= est, (estimate, measured)


def test_transport_memory_is_the_topology_cap_where_ranks_share_a_host() -> None:
    plan = _plan({f"t{i}": "row_wise" for i in range(TABLES)})
    on = plan_stats(plan, _tables(), Topology(2), BATCH)
    off = plan_stats(plan, _tables(), Topology(2, intra_host_transport_bytes=0), BATCH)
    small = plan_stats(plan, _tables(), Topology(2, intra_host_transport_bytes=1 << 20), BATCH)
    for a, b, c in zip(on.ranks, off.ranks, small.ranks):
        assert (a.transport_memory, b.transport_memory, c.transport_memory) == (CAP, 0, 1 << 20)
        assert a.memory == pytest.approx(b.memory + CAP)
    # two hosts of one rank: every group goes through the backend, nothing through /dev/shm
    two_hosts = plan_stats(plan, _tables(), Topology(2, local_world_size=1), BATCH)
    assert all(r.transport_memory == 0 for r in two_hosts.ranks)
    # data-parallel tables only: their all-reduce is the backend's
    dp = _plan({f"t{i}": "data_parallel" for i in range(TABLES)})
    assert all(r.transport_memory == 0 for r in plan_stats(dp, _tables(), Topology(2), BATCH).ranks)


def test_the_planner_reserves_the_transport_cap() -> None:
    reserve = StorageReservation(0.0, 0.0).reserve
    with_transport = reserve(Topology(2), _tables(), BATCH)
    without = reserve(Topology(2, intra_host_transport_bytes=0), _tables(), BATCH)
    alone = reserve(Topology(1), _tables(), BATCH)
    assert with_transport.transport_bytes == CAP and without.transport_bytes == 0
    assert [d + CAP for d in with_transport.ddr] == without.ddr
    assert alone.transport_bytes == 0  # one rank: nothing to carry
    cuda = reserve(Topology(2, "cuda"), _tables(), BATCH)
    assert cuda.transport_bytes == 0
    with pytest.raises(ValueError, match="intra_host_transport_bytes must be an integer >= 0"):
        Topology(2, intra_host_transport_bytes=-1)
