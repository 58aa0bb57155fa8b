"""`CacheParams` / `CacheStatistics` (TorchRec's `torchrec.distributed.types` contract): a
TorchRec-style script's constraints, their JSON forms, and the estimators' use of
`stats.expected_lookups` (distinct rows per global batch) and `stats.expected_miss_rate`."""

from __future__ import annotations

import pytest

from recshard import DataType
from recshard.planner import (
    EmbeddingPerfEstimator,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    TableMeta,
    Topology,
)
from recshard.planner.cache_params_json import cache_params_from_dict
from recshard.planner.cost.cache_stats import cache_hit_rate, touched_rows
from recshard.planner.cost.estimators import data_parallel_exchange
from recshard.planner.plan_io import plan_from_dict, plan_to_dict
from recshard.planner.profile import (
    CalibrationProfile,
    KernelCost,
    LinkCost,
    distinct_rows,
    working_rows,
)
from recshard.planner.report.tables_file import InputError, parse_tables
from recshard.port import port_source
from recshard.types import CacheAlgorithm, CacheParams, CacheStatistics, ShardingPlan

TORCHREC_SCRIPT = """
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import CacheAlgorithm, CacheParams, CacheStatistics
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection


class MyCacheStatistics(CacheStatistics):
    def __init__(self, expected_lookups: int, cacheability: float) -> None:
        self._expected_lookups = expected_lookups
        self._cacheability = cacheability

    @property
    def expected_lookups(self) -> int:
        return self._expected_lookups

    def expected_miss_rate(self, clf: float) -> float:
        return 1.0 - clf

    @property
    def cacheability(self) -> float:
        return self._cacheability


def plan(expected_lookups):
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="t0", embedding_dim=64, num_embeddings=1_000_000, feature_names=["f0"])],
        device=torch.device("meta"))
    stats = None if expected_lookups is None else MyCacheStatistics(expected_lookups, 0.2)
    constraints = {"t0": ParameterConstraints(
        sharding_types=["data_parallel"], pooling_factors=[50.0],
        cache_params=CacheParams(algorithm=CacheAlgorithm.LRU, load_factor=0.2, stats=stats))}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"),
                                       constraints=constraints, debug=False)
    return planner, planner.plan(ebc, [EmbeddingBagCollectionSharder()])
"""


def test_torchrec_style_script_ports_and_its_stats_reach_the_plan():
    result = port_source(TORCHREC_SCRIPT)
    assert result.issues == [] and "torchrec" not in result.code
    assert "from recshard.types import CacheAlgorithm, CacheParams, CacheStatistics" in result.code
    namespace: dict = {}
    exec(compile(result.code, "ported_script", "exec"), namespace)  # noqa: S102 - our source
    with_stats, plan = namespace["plan"](1_000)
    without, _ = namespace["plan"](None)
    params = plan.plan[""]["t0"].cache_params
    assert isinstance(params, CacheParams) and params.algorithm is CacheAlgorithm.LRU
    assert params.stats.expected_lookups == 1_000  # the object the script passed, in the plan
    # 1,000 distinct rows of 1e6 exchanged, not the ~50 k uniform ids of 2 x 512 x 50 would touch
    exchanged = with_stats.last_stats.ranks[0].bwd_comms
    assert 0 < exchanged < 0.1 * without.last_stats.ranks[0].bwd_comms


class _Stats(CacheStatistics):
    """Fixed statistics: `lookups` distinct rows per global batch, miss rate `1 - clf^2`."""

    def __init__(self, lookups: float) -> None:
        self._lookups = lookups

    @property
    def expected_lookups(self) -> float:
        return self._lookups

    def expected_miss_rate(self, clf: float) -> float:
        return 1.0 - clf * clf

    @property
    def cacheability(self) -> float:
        return 0.5


def _kernel_profile() -> CalibrationProfile:
    """1e-4 ms per id, 1e-6 ms per updated element in backward; fixed costs 0.1 ms."""
    kernels = [
        KernelCost("fused", phase, 64, 1e-4, 0.0, 1e-6 if phase == "bwd" else 0.0, 0.1)
        for phase in ("fwd", "bwd")
    ]
    links = [
        LinkCost(c, "intra", 2, 2.0, 0.1) for c in ("all_to_all", "reduce_scatter", "all_gather")
    ]
    return CalibrationProfile("cpu", 1, 2, 2, kernels, links)


def test_fused_update_prices_the_stats_distinct_rows():
    table = TableMeta("t", 100_000, 64, pooling_factors=[10.0])
    est = EmbeddingPerfEstimator(Topology(2, profile=_kernel_profile()), 512)
    ids = 2 * 512 * 10  # a global batch: table-wise receives every rank's ids
    skewed = CacheParams(stats=_Stats(500.0))
    tw = est.estimate(table, "table_wise", "fused", 100_000, 64, skewed)
    assert tw.bwd_compute == pytest.approx(ids * 1e-4 + 500 * 64 * 1e-6)
    plain = est.estimate(table, "table_wise", "fused", 100_000, 64)
    assert plain.bwd_compute == pytest.approx(ids * 1e-4 + distinct_rows(100_000, ids) * 64 * 1e-6)
    # a row block gets its share of the rows and of the distinct rows; a column shard all of them
    rw = est.estimate(table, "row_wise", "fused", 25_000, 64, skewed)
    assert rw.bwd_compute == pytest.approx(ids / 4 * 1e-4 + 125 * 64 * 1e-6)
    cw = est.estimate(table, "column_wise", "fused", 100_000, 32, skewed)
    assert touched_rows(table, skewed, 100_000, ids, ids) == 500
    assert cw.bwd_compute < tw.bwd_compute
    # no stats (or stats-less CacheParams): uniform ids, as before
    assert touched_rows(table, CacheParams(load_factor=0.5), 100, 50.0, ids) == distinct_rows(
        100, 50.0
    )


def test_skewed_ids_cost_what_they_cost_in_a_table_of_their_working_rows():
    # an id costs 1e-4 ms in a 2 k-row table, 4e-4 in a 200 k-row one (log-interpolated between)
    kernels = [
        KernelCost(
            kernel,
            phase,
            64,
            1e-4,
            0.0,
            0.0,
            0.0,
            ms_per_id_cold=4e-4,
            hot_rows=2_000,
            cold_rows=200_000,
        )
        for kernel in ("fused", "dense")
        for phase in ("fwd", "bwd")
    ]
    profile = CalibrationProfile("cpu", 1, 2, 2, kernels, _kernel_profile().links)
    est = EmbeddingPerfEstimator(Topology(2, profile=profile), 512)
    table = TableMeta("t", 200_000, 64, pooling_factors=[10.0])
    ids = 2 * 512 * 10
    uniform = est.estimate(table, "table_wise", "fused", 200_000, 64)
    assert uniform.fwd_compute == pytest.approx(ids * 4e-4)
    # the ids touch as few rows as uniform draws from 2 k rows would: a hot table's cost
    hot = distinct_rows(2_000, ids)
    assert working_rows(200_000, hot, ids) == pytest.approx(2_000, rel=1e-5)
    skewed = est.estimate(table, "table_wise", "fused", 200_000, 64, CacheParams(stats=_Stats(hot)))
    assert skewed.fwd_compute == pytest.approx(ids * 1e-4)
    # as few as from 20 k rows: halfway in log rows
    warm = est.estimate(
        table,
        "table_wise",
        "fused",
        200_000,
        64,
        CacheParams(stats=_Stats(distinct_rows(20_000, ids))),
    )
    assert warm.fwd_compute == pytest.approx(ids * 2.5e-4)
    # as many distinct rows as uniform ids (or more): the table's own size
    assert working_rows(200_000, 2 * ids, ids) == 200_000
    # the dense kernel updates the whole table: its per-id cost stays the table's
    dense = est.estimate(table, "table_wise", "dense", 200_000, 64, CacheParams(stats=_Stats(hot)))
    assert dense.fwd_compute == pytest.approx(ids * 4e-4)


def test_data_parallel_exchange_and_cache_hits_use_the_stats():
    table = TableMeta("t", 1_000_000, 64, pooling_factors=[4.0])
    params = CacheParams(stats=_Stats(2_000.0))
    assert data_parallel_exchange(table, 2, 512, cache_params=params) == pytest.approx(
        (1e6 + 4.0 * 2_000 * 64, 2)
    )
    busy = CacheParams(stats=_Stats(600_000.0))  # more than half the rows: the whole gradient
    assert data_parallel_exchange(table, 2, 512, cache_params=busy) == pytest.approx(
        (1e6 + 4.0 * 1e6 * 64, 2)
    )
    assert cache_hit_rate(CacheParams(load_factor=0.5, stats=_Stats(1.0)), 1_000) == 0.25
    assert cache_hit_rate(CacheParams(stats=_Stats(1.0)), 1_000) == pytest.approx(0.04)  # lf 0.2
    without = cache_hit_rate(CacheParams(load_factor=0.5), 1_000)
    assert 0.5 < without < 1.0  # the Zipf-like default
    est = EmbeddingPerfEstimator(Topology(2, "cuda"), 512)
    cold = est.kernel_bw(
        "fused_uvm_caching", CacheParams(load_factor=0.5, stats=_Stats(1.0)), 1_000
    )
    assert (
        est.kernel_bw("fused_uvm", None, 1_000)
        < cold
        < est.kernel_bw("fused_uvm_caching", CacheParams(load_factor=0.5), 1_000)
    )


def test_expected_lookups_beyond_the_rows_is_an_error_naming_the_table():
    table = TableMeta("users", 1_000, 16, module_fqn="sparse.ebc")
    with pytest.raises(ValueError, match=r"table 'sparse.ebc.users'.*1000 rows.*got 5000"):
        data_parallel_exchange(table, 2, 512, cache_params=CacheParams(stats=_Stats(5_000.0)))
    est = EmbeddingPerfEstimator(Topology(2, profile=_kernel_profile()), 512)
    with pytest.raises(ValueError, match="expected_lookups"):
        est.estimate(
            table, "table_wise", "fused", 1_000, 16, CacheParams(stats=_Stats(float("nan")))
        )


def test_dict_cache_params_convert_and_bad_ones_are_named():
    constraints = ParameterConstraints(
        cache_params={"load_factor": 0.3, "algorithm": "lfu", "precision": "fp16"}
    )
    assert constraints.cache_params == CacheParams(
        algorithm=CacheAlgorithm.LFU, load_factor=0.3, precision=DataType.FP16
    )
    with pytest.raises(ValueError, match=r"unknown keys \['hit_rate'\]"):
        ParameterConstraints(cache_params={"hit_rate": 0.9})
    with pytest.raises(ValueError, match="stats: pass a CacheParams"):
        cache_params_from_dict({"stats": {"expected_lookups": 10}})
    with pytest.raises(ValueError, match="algorithm is one of"):
        cache_params_from_dict({"algorithm": "FIFO"})
    with pytest.raises(ValueError, match="load_factor must be a number >= 0, got -0.1"):
        cache_params_from_dict({"load_factor": -0.1})
    with pytest.raises(ValueError, match="must be a CacheParams"):
        ParameterConstraints(cache_params=0.2)  # type: ignore[arg-type]
    data = {
        "tables": [
            {
                "name": "t",
                "num_embeddings": 10,
                "embedding_dim": 8,
                "constraints": {"cache_params": {"load_factor": 0.2, "bogus": 1}},
            }
        ]
    }
    with pytest.raises(InputError, match=r"table 't': bad constraints: cache_params: unknown"):
        parse_tables(data)
    data["tables"][0]["constraints"]["cache_params"] = {"load_factor": 0.2}
    _, parsed = parse_tables(data)
    assert parsed["t"].cache_params == CacheParams(load_factor=0.2)


def test_plan_json_keeps_cache_params_but_not_stats():
    params = CacheParams(
        algorithm=CacheAlgorithm.LRU, load_factor=0.25, precision=DataType.FP16, stats=_Stats(7.0)
    )
    assert hash(params) == hash(
        CacheParams(algorithm=CacheAlgorithm.LRU, load_factor=0.25, precision=DataType.FP16)
    )  # stats not hashed
    table = TableMeta("t", 100, 8)
    saved = plan_to_dict(_plan_one(table, params))
    assert saved["modules"][""]["t"]["cache_params"] == {
        "algorithm": "LRU",
        "load_factor": 0.25,
        "precision": "FP16",
    }
    loaded = plan_from_dict(saved).plan[""]["t"].cache_params
    assert loaded == CacheParams(
        algorithm=CacheAlgorithm.LRU, load_factor=0.25, precision=DataType.FP16
    )
    saved["modules"][""]["t"]["cache_params"] = {"load_factor": "x"}
    with pytest.raises(ValueError, match=r"modules.*t.*cache_params: load_factor"):
        plan_from_dict(saved)


def _plan_one(table: TableMeta, params: CacheParams) -> ShardingPlan:
    planner = EmbeddingShardingPlanner(
        Topology(2),
        constraints={
            table.name: ParameterConstraints(sharding_types=["table_wise"], cache_params=params)
        },
        debug=False,
    )
    plan = planner.plan_tables([table])
    assert plan.plan[""]["t"].cache_params is params
    return plan
