"""The planner on real modules (meta device) and sharders, plan files, and collective_plan."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from recshard.plan.sharding_types import SEQUENCE_SHARDING_TYPES
from recshard.plan.validate import check_module_plan
from recshard.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
    load_plan,
    plan_to_dict,
    save_plan,
    validate_plan,
)
from recshard.planner.plan_io import PlanValidationError
from recshard.types import BoundsCheckMode, CacheParams, ModuleSharder, ShardingType

GIB = 1024**3


class _SequenceSharder(ModuleSharder[EmbeddingCollection]):
    """Stand-in EC sharder: the sequence sharding types, fused or dense."""

    @property
    def module_type(self) -> type:
        return EmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return ["data_parallel", "table_wise", "column_wise", "row_wise"]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return ["dense"] if sharding_type == "data_parallel" else ["fused", "dense"]

    def shardable_parameters(self, module: EmbeddingCollection) -> Dict[str, nn.Parameter]:
        return {c.name: module.embeddings[c.name].weight for c in module.embedding_configs()}

    def shard(self, module, params, env, device=None):  # pragma: no cover - not used here
        raise NotImplementedError


class _Sparse(nn.Module):
    def __init__(self, n: int, device: str = "meta") -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=1000 * (i + 1) ** 3,
                    embedding_dim=16 * (1 + i % 4),
                    name=f"bag{i}",
                    feature_names=[f"f{i}"],
                )
                for i in range(n)
            ],
            device=device,
        )
        self.ec = EmbeddingCollection(
            [
                EmbeddingConfig(
                    num_embeddings=5000, embedding_dim=32, name="seq0", feature_names=["s0"]
                )
            ],
            device=device,
        )


class _Model(nn.Module):
    def __init__(self, n: int = 6, device: str = "meta") -> None:
        super().__init__()
        self.sparse = _Sparse(n, device)
        self.dense = nn.Linear(512, 512, device=device)


def _sharders(optimizer: str = "exact_row_wise_adagrad") -> list:
    return [
        EmbeddingBagCollectionSharder(fused_params={"optimizer": optimizer}),
        _SequenceSharder(),
    ]


def test_plan_module_covers_every_table_and_passes_module_checks():
    model = _Model()
    topo = Topology(4, local_world_size=2)
    plan = EmbeddingShardingPlanner(topo, debug=False).plan(model, _sharders())
    assert set(plan.plan) == {"sparse.ebc", "sparse.ec"}
    assert set(plan.plan["sparse.ebc"]) == {f"bag{i}" for i in range(6)}
    assert plan.plan["sparse.ec"]["seq0"].sharding_type in _SequenceSharder().sharding_types("cpu")
    validate_plan(plan, model, world_size=4)
    check_module_plan(
        model.sparse.ebc.embedding_bag_configs(),
        plan.plan["sparse.ebc"],
        "EmbeddingBagCollection",
        world_size=4,
        local_world_size=2,
    )
    check_module_plan(
        model.sparse.ec.embedding_configs(),
        plan.plan["sparse.ec"],
        "EmbeddingCollection",
        world_size=4,
        local_world_size=2,
        sharding_types=SEQUENCE_SHARDING_TYPES,
    )


def test_every_sharding_type_passes_module_checks():
    model = _Model(n=6)
    topo = Topology(4, local_world_size=2)
    types = [st.value for st in ShardingType]
    constraints = {
        f"bag{i}": ParameterConstraints(sharding_types=[st], min_partition=8)
        for i, st in enumerate(types)
    }
    plan = EmbeddingShardingPlanner(topo, constraints=constraints, debug=False).plan(
        model, _sharders()
    )
    assert [plan.plan["sparse.ebc"][f"bag{i}"].sharding_type for i in range(6)] == types
    check_module_plan(
        model.sparse.ebc.embedding_bag_configs(),
        plan.plan["sparse.ebc"],
        "EmbeddingBagCollection",
        world_size=4,
        local_world_size=2,
    )
    validate_plan(plan, model, world_size=4, local_world_size=2)
    twcw = plan.plan["sparse.ebc"]["bag5"]  # table_column_wise: move a shard to the other host
    twcw.shards[0].placement = "rank:2/cpu" if twcw.shards[1].rank < 2 else "rank:0/cpu"
    with pytest.raises(PlanValidationError, match="bag5'.*span hosts"):
        validate_plan(plan, model, world_size=4, local_world_size=2)


def test_optimizer_state_from_fused_params_and_dense_reservation():
    model = _Model()
    topo = Topology(2)
    sgd = EmbeddingShardingPlanner(topo, debug=False)
    sgd.plan(model, _sharders("exact_sgd"))
    adam = EmbeddingShardingPlanner(topo, debug=False)
    adam.plan(model, _sharders("adam"))
    used = lambda p: sum(r.ddr for r in p.last_stats.ranks)  # noqa: E731
    assert used(adam) > 2.5 * used(sgd)  # Adam state counted with no optimizer attached
    dense_bytes = (512 * 512 + 512) * 4
    assert sgd.last_stats.reserved_dense_bytes == 4 * dense_bytes


def test_plan_file_round_trip(tmp_path):
    model = _Model()
    constraints = {
        "bag1": ParameterConstraints(sharding_types=["column_wise"], min_partition=8),
        "sparse.ebc.bag2": ParameterConstraints(
            bounds_check_mode=BoundsCheckMode.WARNING, cache_params={"load_factor": 0.3}
        ),
    }
    plan = EmbeddingShardingPlanner(Topology(3), constraints=constraints, debug=False).plan(
        model, _sharders()
    )
    path = str(tmp_path / "plan.json")
    save_plan(plan, path, metadata={"note": "test"})
    loaded = load_plan(path)
    assert plan_to_dict(loaded) == plan_to_dict(plan)
    assert loaded.plan["sparse.ebc"]["bag1"].shards == plan.plan["sparse.ebc"]["bag1"].shards
    bag2 = loaded.plan["sparse.ebc"]["bag2"]
    assert bag2.bounds_check_mode == BoundsCheckMode.WARNING
    assert bag2.cache_params == CacheParams(load_factor=0.3)
    validate_plan(loaded, model, world_size=3)


def test_validate_plan_names_the_mismatch(tmp_path):
    model = _Model()
    plan = EmbeddingShardingPlanner(Topology(2), debug=False).plan(model, _sharders())
    other = _Model(n=5)
    with pytest.raises(
        PlanValidationError,
        match=r"module 'sparse.ebc': the plan names tables \['bag5'\] that the module lacks",
    ):
        validate_plan(plan, other)
    bigger = _Model()
    bigger.sparse.ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=2000 * (i + 1) ** 3,
                embedding_dim=16 * (1 + i % 4),
                name=f"bag{i}",
                feature_names=[f"f{i}"],
            )
            for i in range(6)
        ],
        device="meta",
    )
    with pytest.raises(PlanValidationError, match="table 'sparse.ebc.bag"):
        validate_plan(plan, bigger)
    with pytest.raises(PlanValidationError, match="outside world size 1"):
        validate_plan(plan, model, world_size=1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "recshard.sharding_plan", "version": 99, "modules": {}}')
    with pytest.raises(PlanValidationError, match="version 99"):
        load_plan(str(bad))
    path = str(tmp_path / "plan.json")
    save_plan(plan, path)
    assert plan_to_dict(load_plan(path, model, world_size=2)) == plan_to_dict(plan)
    with pytest.raises(PlanValidationError, match=r"plan.json: table 'sparse.ebc.bag"):
        load_plan(path, bigger)


def test_no_shardable_module_is_an_error():
    with pytest.raises(PlannerError, match="no shardable tables"):
        EmbeddingShardingPlanner(Topology(2), debug=False).plan(nn.Linear(2, 2), _sharders())


def _collective(rank: int, world_size: int, ddr_gbs: List[float]) -> List[dict]:
    torch.manual_seed(rank)  # nothing in planning may depend on per-rank state
    results = []
    for ddr_gb in ddr_gbs:
        planner = EmbeddingShardingPlanner(Topology(world_size, ddr_cap=ddr_gb * GIB), debug=False)
        try:
            results.append(plan_to_dict(planner.collective_plan(_Model(), _sharders())))
        except PlannerError as e:
            results.append({"error": str(e)})
    return results


def test_collective_plan_is_identical_on_every_rank_and_broadcasts_failure():
    results = run_ranks(2, _collective, [64.0, 0.07], timeout=90)
    assert results[0][0] == results[1][0] and "error" not in results[0][0]
    assert results[0][1]["error"].startswith("no sharding plan fits")
    assert results[1][1]["error"].startswith("rank 0 failed to plan: PlannerError: no sharding")


def test_collective_plan_on_three_ranks():
    results = run_ranks(3, _collective, [64.0], timeout=90)
    assert "error" not in results[0][0]
    assert results[0] == results[1] == results[2]
