"""Plan helpers as TorchRec calls them: `ParameterSharding.sharding_spec`,
`collective_plan(module)` with default sharders, `recshard.distributed.ShardingEnv`, and a
plan from `construct_module_sharding_plan(ebc, {...}, sharder, local_size=..., world_size=...,
device_type=...)` that DMP trains like the unsharded model on 2 ranks."""

from __future__ import annotations

import copy
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    ShardingEnv,
)
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.planner import EmbeddingShardingPlanner, Topology
from recshard.types import ShardingPlan
from tests.distributed.dmp_cases import LR, TinyDLRM, make_optimizer, train
from tests.multiprocess import run_ranks


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=8, num_embeddings=10, feature_names=[f"f{i}"]
            )
            for i in range(3)
        ]
    )


def test_sharding_spec_lists_the_shards() -> None:
    plan = construct_module_sharding_plan(
        _ebc(),
        {"t0": column_wise(ranks=[1, 0]), "t1": row_wise(), "t2": data_parallel()},
        world_size=2,
    )
    spec = plan["t0"].sharding_spec
    assert isinstance(spec, EnumerableShardingSpec)
    assert [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in spec.shards] == [
        ([0, 0], [10, 4], "rank:1/cpu"),
        ([0, 4], [10, 4], "rank:0/cpu"),
    ]
    assert [s.shard_sizes for s in plan["t1"].sharding_spec.shards] == [[5, 8], [5, 8]]
    assert plan["t2"].sharding_spec is None


def _collective(rank: int, ws: int) -> Tuple[List[str], int]:
    planner = EmbeddingShardingPlanner(Topology(world_size=ws, compute_device="cpu"))
    plan = planner.collective_plan(_ebc())  # no sharders: DMP's defaults
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return sorted(plan.plan[""]), env.world_size


def test_collective_plan_defaults_its_sharders() -> None:
    for tables, world_size in run_ranks(2, _collective, timeout=120):
        assert (tables, world_size) == (["t0", "t1", "t2"], 2)


def _torchrec_style_training(rank: int, ws: int) -> Tuple[List[float], List[float]]:
    torch.manual_seed(0)
    reference = TinyDLRM()
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LR}
    )
    module_plan = construct_module_sharding_plan(
        reference.ebc,
        {"ta": table_wise(1, "cpu"), "tb": row_wise(None, "dense"), "tc": column_wise([1, 0])},
        sharder,
        local_size=ws,
        world_size=ws,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        copy.deepcopy(reference), plan=ShardingPlan({"ebc": module_plan}), sharders=[sharder]
    )
    got = train(dmp, make_optimizer(dmp, True, False), range(3), rank, ws)
    want = train(reference, make_optimizer(reference, False, False), range(3), 0, 1)
    return got, want


def test_torchrec_style_plan_trains_like_the_unsharded_model() -> None:
    for got, want in run_ranks(2, _torchrec_style_training, timeout=240):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5), (got, want)
