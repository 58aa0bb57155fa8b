"""The planner and `key_value` tables (cpu): `Topology.ddr_cap` is each rank's DRAM budget and
`storage_cap` its local storage; a table whose shards do not fit DRAM is planned `key_value`
(never into memory the rank does not have), priced by its cache's expected hit rate
(`CacheStatistics`), and the stats, `plan_stats` and `--explain` show DRAM and storage bytes
per rank. A planned key_value plan trains through DMP like the unsharded model."""

from __future__ import annotations

import copy
import json
import math
from typing import List, Tuple

import pytest
import torch
from multiprocess import run_ranks

from recshard.lookup.fused_params import FusedParams
from recshard.lookup.key_value import SLOT_BYTES, dram_bytes
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from recshard.planner import (
    EmbeddingPerfEstimator,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    TableMeta,
    Topology,
)
from recshard.planner.cost.plan_stats import plan_stats
from recshard.planner.cost.storage import EmbeddingStorageEstimator
from recshard.planner.planner_types import GIB, PlannerError
from recshard.planner.report.cli import main
from recshard.types import CacheParams, CacheStatistics, EmbeddingComputeKernel

OPTIMIZER = "exact_row_wise_adagrad"


def big() -> TableMeta:  # 10M x 64 fp32 + row-wise state: 2.42 GiB
    return TableMeta("big", 10_000_000, 64, ["f"], optimizer=OPTIMIZER)


def small() -> TableMeta:
    return TableMeta("small", 100_000, 64, ["g"], optimizer=OPTIMIZER)


def kernels(planner: EmbeddingShardingPlanner, tables: List[TableMeta]) -> dict:
    plan = planner.plan_tables(tables)
    return {n: ps.compute_kernel for m in plan.plan.values() for n, ps in m.items()}


def test_table_over_dram_is_planned_key_value_within_budget() -> None:
    topology = Topology(2, ddr_cap=1 * GIB, storage_cap=8 * GIB)
    planner = EmbeddingShardingPlanner(topology, batch_size=512)
    assert kernels(planner, [big(), small()]) == {"big": "key_value", "small": "fused"}
    stats = planner.last_stats
    assert all(r.ddr <= r.ddr_cap for r in stats.ranks)
    assert sum(r.storage for r in stats.ranks) == pytest.approx(10_000_000 * (64 + 1) * 4)
    text = stats.format()
    assert "storage GiB (%)" in text and "key_value" in text


def test_without_storage_a_table_over_dram_is_an_error() -> None:
    planner = EmbeddingShardingPlanner(Topology(2, ddr_cap=1 * GIB), batch_size=512)
    with pytest.raises(PlannerError, match="big"):
        planner.plan_tables([big(), small()])


def test_too_little_storage_is_an_error_naming_it() -> None:
    topology = Topology(2, ddr_cap=1 * GIB, storage_cap=0.5 * GIB)
    with pytest.raises(PlannerError, match="'big'.*storage_cap"):
        EmbeddingShardingPlanner(topology, batch_size=512).plan_tables([big()])
    one_rank = Topology(1, ddr_cap=2 * GIB, storage_cap=2 * GIB)  # no shard of 2.42 GiB fits
    with pytest.raises(PlannerError, match="storage_cap"):
        EmbeddingShardingPlanner(one_rank, batch_size=512).plan_tables([big()])


def test_tables_that_fit_dram_stay_in_memory_unless_constraints_name_key_value() -> None:
    topology = Topology(2, ddr_cap=64 * GIB, storage_cap=64 * GIB)
    assert kernels(EmbeddingShardingPlanner(topology, batch_size=512), [big()]) == {"big": "fused"}
    named = {"big": ParameterConstraints(compute_kernels=["key_value"])}
    planner = EmbeddingShardingPlanner(topology, batch_size=512, constraints=named)
    assert kernels(planner, [big()]) == {"big": "key_value"}


class _Stats(CacheStatistics):
    """`lookups` distinct rows per global batch; a cache of `clf` misses `miss` of them."""

    def __init__(self, lookups: float, miss: float) -> None:
        self._lookups, self._miss = lookups, miss

    @property
    def expected_lookups(self) -> float:
        return self._lookups

    def expected_miss_rate(self, clf: float) -> float:
        return self._miss

    @property
    def cacheability(self) -> float:
        return self._miss


def test_perf_prices_misses_and_write_back_at_storage_bandwidth() -> None:
    """key_value - fused = misses read + touched rows written, at `storage_bw`."""
    topology = Topology(2, storage_cap=64 * GIB, storage_bw=2.0)
    estimator = EmbeddingPerfEstimator(topology, batch_size=512)
    table = big()
    rows = table.num_embeddings // 2
    row_bytes = 64 * 4 + 4  # the row and its row-wise state
    for miss in (0.0, 0.3, 1.0):
        params = CacheParams(load_factor=0.1, stats=_Stats(4000.0, miss))
        kv = estimator.estimate(table, "row_wise", "key_value", rows, 64, params)
        fused = estimator.estimate(table, "row_wise", "fused", rows, 64, params)
        touched = 4000.0 / 2  # a row block's share of the distinct rows
        ms = touched * row_bytes / (2.0 * 1e6)  # bytes / (bytes per ms)
        assert kv.fwd_compute - fused.fwd_compute == pytest.approx(miss * ms)
        assert kv.bwd_compute - fused.bwd_compute == pytest.approx(ms)
        assert kv.fwd_comms == fused.fwd_comms and kv.input_dist == fused.input_dist


def _kv_dram(load_factor: float, lookups: float) -> Tuple[float, float, LocalTable, FusedParams]:
    """(DRAM beyond the step's io, storage) the planner gives a 123,457 x 24 table-wise
    key_value shard whose steps read `lookups` distinct rows; its LocalTable and params."""
    topology = Topology(1, storage_cap=64 * GIB)
    estimator = EmbeddingStorageEstimator(topology, batch_size=512)
    table = TableMeta("t", 123_457, 24, ["f"], optimizer=OPTIMIZER)
    params = CacheParams(load_factor=load_factor, stats=_Stats(lookups, 0.5))
    kv = estimator.estimate(table, "table_wise", "key_value", 123_457, 24, params)
    fused = estimator.estimate(table, "table_wise", "fused", 123_457, 24, params)
    io = fused.ddr - 123_457 * (24 + 1) * 4
    config = EmbeddingBagConfig(num_embeddings=123_457, embedding_dim=24, name="t")
    parsed = FusedParams.parse({"optimizer": OPTIMIZER, "cache_load_factor": load_factor}, "t")
    local = LocalTable(
        config, 123_457, 24, 0, 0, EmbeddingComputeKernel.KEY_VALUE, PoolingType.SUM, parsed
    )
    return kv.ddr - io, kv.storage, local, parsed


@pytest.mark.parametrize("lookups", [4000.0, 50_000.0])
def test_dram_estimate_equals_the_kernels(lookups: float) -> None:
    """The planner's DRAM for a key_value shard (beyond the step's io) is what the kernel
    holds (`recshard.lookup.key_value.dram_bytes`) for a step of that many distinct rows
    (more than the cache: the transient stops at the cache's size)."""
    dram, storage, local, parsed = _kv_dram(0.07, lookups)
    assert dram == pytest.approx(dram_bytes(local, parsed.optim, int(lookups)))
    assert storage == 123_457 * (24 + 1) * 4


def test_dram_counts_the_cache_once() -> None:
    """A cached row costs its row once plus its slot bytes: the weights' file is not mapped
    (rows move by pread/pwrite), so nothing doubles the cache; the row-wise state is mapped
    whole (4 bytes a row whatever the load factor) and cached by slot (4 bytes a slot)."""
    record = 24 * 4 + 4
    small, _, _, _ = _kv_dram(0.05, 100.0)
    large, _, _, _ = _kv_dram(0.25, 100.0)
    extra_slots = math.ceil(0.25 * 123_457) - math.ceil(0.05 * 123_457)
    assert large - small == pytest.approx(extra_slots * (record + SLOT_BYTES))


def test_plan_stats_and_explain_show_storage(tmp_path, capsys) -> None:  # noqa: ANN001
    topology = Topology(2, ddr_cap=1 * GIB, storage_cap=8 * GIB)
    planner = EmbeddingShardingPlanner(topology, batch_size=512)
    plan = planner.plan_tables([big(), small()])
    loads = plan_stats(plan, [big(), small()], topology, batch_size=512).ranks
    assert sum(r.storage for r in loads) == pytest.approx(10_000_000 * 65 * 4)
    assert all(r.memory < 1 * GIB for r in loads)
    path = tmp_path / "tables.json"
    spec = [
        {"name": t.name, "num_embeddings": t.num_embeddings, "embedding_dim": 64}
        for t in (big(), small())
    ]
    path.write_text(json.dumps({"world_size": 2, "batch_size": 512, "tables": spec}))
    flags = ["--ddr-gb", "1", "--storage-gb", "8", "--optimizer", OPTIMIZER]
    assert main([str(path), *flags, "--explain", "big"]) == 0
    out = capsys.readouterr().out
    assert "storage MiB" in out and "row_wise/key_value/2" in out, out


def _train_planned(rank: int, world_size: int) -> Tuple[List[float], List[float], str]:
    from dmp_cases import TinyDLRM, make_optimizer, train

    from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder

    torch.manual_seed(0)
    reference = TinyDLRM()
    sharders = [
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "exact_sgd", "learning_rate": 0.05}
        )
    ]
    constraints = {
        "ta": ParameterConstraints(
            compute_kernels=["key_value"],
            cache_params=CacheParams(load_factor=1.0),  # a 10-row table
        )
    }
    topology = Topology(world_size, local_world_size=1, storage_cap=GIB)
    planner = EmbeddingShardingPlanner(topology, constraints=constraints)
    plan = planner.collective_plan(reference, sharders)
    dmp = DistributedModelParallel(copy.deepcopy(reference), sharders=sharders, plan=plan)
    got = train(dmp, make_optimizer(dmp, True, False), range(3), rank, world_size)
    want = train(reference, make_optimizer(reference, False, False), range(3), 0, 1)
    return got, want, str(plan)


def test_planned_key_value_plan_trains_like_unsharded() -> None:
    got, want, plan = run_ranks(2, _train_planned, timeout=200, env={"LOCAL_WORLD_SIZE": "1"})[0]
    assert "key_value" in plan
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5), (got, want)
