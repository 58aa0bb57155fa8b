"""The shared-memory transport's resident pages in the planner's per-rank memory estimate
(issue #22, memory target): `plan_stats`' `transport_memory` against the resident pages of
the /dev/shm segments that two real ranks have mapped after training a sharded module, and
the slot layout of `shm.resident_bytes`."""

from __future__ import annotations

import mmap
from typing import Dict, List

import pytest
import torch
from multiprocess import run_ranks
from planner_cases import shard_on_world

from recshard.comm import shm
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, TableMeta, Topology
from recshard.planner.plan_stats import plan_stats
from recshard.sparse import KeyedJaggedTensor
from recshard.types import ShardingPlan

ROWS, DIM, POOL, BATCH, TABLES = 4000, 64, 3, 256, 4
PAGE = mmap.PAGESIZE


def _tables() -> List[TableMeta]:
    return [
        TableMeta(f"t{i}", ROWS, DIM, feature_names=[f"f{i}"], pooling_factors=[float(POOL)])
        for i in range(TABLES)
    ]


def _plan(types: Dict[str, str]) -> ShardingPlan:
    constraints = {
        name: ParameterConstraints(sharding_types=[st], compute_kernels=["fused"])
        for name, st in types.items()
    }
    return EmbeddingShardingPlanner(
        Topology(2), BATCH, constraints=constraints, debug=False
    ).plan_tables(_tables())


def _segment_pages() -> int:
    """Resident bytes of this process's mappings of the transport's data segments."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's header line
                inside = "/dev/shm/recshard-" in line and "-ctl-" not in line
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def _train(rank: int, world_size: int, plan: ShardingPlan) -> int:
    """Train the planned module `SLOTS + 2` steps on a fixed batch: `POOL` ids per bag."""
    module = shard_on_world(plan, ROWS, DIM, TABLES)
    n = TABLES * BATCH * POOL
    ids = (torch.arange(n) * 7919 + rank) % ROWS
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [f"f{i}" for i in range(TABLES)], ids, torch.full((TABLES * BATCH,), POOL), stride=BATCH
    )
    for _ in range(shm.SLOTS + 2):
        module(kjt).values().sum().backward()
    return _segment_pages()


@pytest.mark.parametrize(
    "types",
    [
        {f"t{i}": "table_wise" for i in range(TABLES)},
        {f"t{i}": "row_wise" for i in range(TABLES)},
        {"t0": "table_wise", "t1": "column_wise", "t2": "row_wise", "t3": "row_wise"},
    ],
    ids=["table_wise", "row_wise", "mixed"],
)
def test_transport_memory_matches_the_segments_ranks_map(types: Dict[str, str]) -> None:
    plan = _plan(types)
    estimate = [r.transport_memory for r in plan_stats(plan, _tables(), Topology(2), BATCH).ranks]
    measured = run_ranks(2, _train, plan, timeout=240)
    for est, meas in zip(estimate, measured):
        # the ids' lengths ride with them on the wire (not in the traffic model): a page or two
        assert meas > 0 and abs(est - meas) <= 0.03 * meas + 2 * PAGE, (estimate, measured)


def test_transport_memory_is_off_with_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan({f"t{i}": "row_wise" for i in range(TABLES)})
    on = plan_stats(plan, _tables(), Topology(2), BATCH)
    monkeypatch.setenv(shm.ENV, "0")
    off = plan_stats(plan, _tables(), Topology(2), BATCH)
    for a, b in zip(on.ranks, off.ranks):
        assert a.transport_memory > 0 and b.transport_memory == 0
        assert a.memory == pytest.approx(b.memory + a.transport_memory)
    # two hosts: the all-rank groups go through the backend, nothing through /dev/shm
    two_hosts = plan_stats(plan, _tables(), Topology(2, local_world_size=1), BATCH)
    assert all(r.transport_memory == 0 for r in two_hosts.ranks)


def test_resident_bytes_follows_the_slot_layout() -> None:
    assert shm.SLOTS == 4  # the cases below spell out 4 slots
    big, small = 10 * PAGE, 3 * PAGE
    assert shm.resident_bytes([big]) == 4 * big  # one call a step: every slot holds it
    assert shm.resident_bytes([big, small]) == 2 * big + 2 * small  # alternate slots
    assert shm.resident_bytes([big, small, small]) == 4 * big  # 3 calls rotate over all 4
    assert shm.resident_bytes([small, small, big, small]) == big + 3 * small
    assert shm.resident_bytes([1.0]) == 4 * PAGE  # whole pages
    assert shm.resident_bytes([0.0]) == 0
