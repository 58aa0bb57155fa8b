"""A FeatureProcessedEmbeddingBagCollection built on `meta` (as `examples/dlrm` builds it) and
sharded by DistributedModelParallel starts with the position weights the unsharded module
starts with (1.0), on every rank, row-wise included; so do processors DMP materializes itself
(unsharded, outside an FP-EBC). Before, the weights held whatever memory `to_empty` returned
and training could blow up within a few steps."""

from __future__ import annotations

from typing import Dict, List

import torch
from ebc_cases import plan_for, tables
from fp_cases import sharder
from multiprocess import run_ranks
from torch import nn

from recshard import EmbeddingBagCollection
from recshard.distributed import DistributedModelParallel
from recshard.distributed.sharding_plan import construct_module_sharding_plan
from recshard.modules.feature_processor_ import PositionWeightedModuleCollection
from recshard.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recshard.types import ShardingEnv, ShardingPlan

LENGTHS = {"f0": 3, "f1": 4}


class _Model(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        ebc = EmbeddingBagCollection(tables(), is_weighted=True, device=device)
        self.fp = FeatureProcessedEmbeddingBagCollection(
            ebc, PositionWeightedModuleCollection(LENGTHS, device=device)
        )
        self.extra = PositionWeightedModuleCollection({"x": 2}, device=device)


def _start_weights(rank: int, ws: int, kind: str) -> Dict[str, List[float]]:
    for _ in range(50):  # fill the allocator's free memory with garbage an empty tensor may get
        torch.full([64], 1e30).add_(0)
    fp_sharder = sharder("fused")
    reference = _Model(torch.device("cpu"))
    module_plan = construct_module_sharding_plan(
        reference.fp,
        plan_for(kind, ws, ws, "fused"),
        sharder=fp_sharder,
        local_size=ws,
        world_size=ws,
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD, local_world_size=ws)
    dmp = DistributedModelParallel(
        _Model(torch.device("meta")),
        env=env,
        plan=ShardingPlan({"fp": module_plan}),
        sharders=[fp_sharder],
    )
    expected = {n: p.tolist() for n, p in reference.named_parameters() if "position" in n}
    got = {n: p.tolist() for n, p in dmp.module.named_parameters() if "position" in n}
    assert got == expected, (got, expected)
    return got


def test_position_weights_built_on_meta_start_at_one_on_every_rank() -> None:
    for kind in ("row_wise", "table_wise"):
        weights = run_ranks(2, _start_weights, kind, timeout=120)
        assert weights[0] == weights[1]
        assert sorted(weights[0]) == [
            "extra.position_weights.x",
            "fp._feature_processors.position_weights.f0",
            "fp._feature_processors.position_weights.f1",
        ]
        assert all(set(v) == {1.0} for v in weights[0].values())
