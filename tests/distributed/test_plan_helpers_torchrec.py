"""Plan helpers as TorchRec calls them: `ParameterSharding.sharding_spec`,
`collective_plan(module)` with default sharders, `recshard.distributed.ShardingEnv`."""

from __future__ import annotations

from typing import List, Tuple

import torch.distributed as dist
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.distributed import ShardingEnv
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
)
from recshard.planner import EmbeddingShardingPlanner, Topology
from tests.multiprocess import run_ranks


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10, feature_names=[f"f{i}"])
        for i in range(3)
    ])


def test_sharding_spec_lists_the_shards() -> None:
    plan = construct_module_sharding_plan(
        _ebc(), {"t0": column_wise(ranks=[1, 0]), "t1": row_wise(), "t2": data_parallel()}, world_size=2)
    spec = plan["t0"].sharding_spec
    assert isinstance(spec, EnumerableShardingSpec)
    assert [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in spec.shards] == [
        ([0, 0], [10, 4], "rank:1/cpu"), ([0, 4], [10, 4], "rank:0/cpu")]
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
