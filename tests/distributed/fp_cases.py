"""Feature-processed EBCs for the sharded tests: the reference module, a model holding it,
and DMP over that model with a manual plan."""

from __future__ import annotations

import copy
from typing import Dict

import torch
from ebc_cases import LR, plan_for, tables
from torch import nn

from recshard import EmbeddingBagCollection, KeyedJaggedTensor
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from recshard.distributed.model_parallel import DataParallelWrapper
from recshard.distributed.sharding_plan import construct_module_sharding_plan
from recshard.modules.feature_processor_ import (
    FeatureProcessor,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from recshard.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recshard.sparse import JaggedTensor, KeyedTensor
from recshard.types import ShardingEnv, ShardingPlan

# bags in `ebc_cases.batch` hold 0-3 ids: 3 is the tightest length that fits
MAX_LENGTHS = {"f0": 3, "f1": 4, "f3": 3, "f5": 5}


class LengthScaled(FeatureProcessor):
    """A processor that is not a position weight: every id of a bag weighs `scale / length`."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, features: JaggedTensor) -> JaggedTensor:
        lengths = features.lengths()
        per_id = torch.repeat_interleave(lengths.clamp(min=1).float(), lengths)
        return JaggedTensor(
            features.values(), self.scale / per_id, lengths=lengths, offsets=features.offsets()
        )


def make_fp_ebc(processors: str, seed: int = 0) -> FeatureProcessedEmbeddingBagCollection:
    """`processors`: "collection" (PositionWeightedModuleCollection over MAX_LENGTHS), "dict"
    (one PositionWeightedModule per feature) or "custom" (dict, f2 and f4 `LengthScaled`).
    Position weights start random, so a wrong position shows in the output."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables(), is_weighted=True)
    features = [f for t in tables() for f in t.feature_names]
    if processors == "collection":
        fps = PositionWeightedModuleCollection(MAX_LENGTHS)
    else:
        fps = {f: PositionWeightedModule(MAX_LENGTHS.get(f, 4)) for f in features}
        if processors == "custom":
            fps["f2"], fps["f4"] = LengthScaled(), LengthScaled()
    module = FeatureProcessedEmbeddingBagCollection(ebc, fps)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "position_weight" in name:
                p.copy_(torch.rand(p.shape) + 0.5)
    return module


class Model(nn.Module):
    """The FP-EBC at a path below the root, as in a real model."""

    def __init__(self, fp: FeatureProcessedEmbeddingBagCollection) -> None:
        super().__init__()
        self.fp = fp

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self.fp(features)


def sharder(kernel: str) -> FeatureProcessedEmbeddingBagCollectionSharder:
    fused = {"optimizer": "exact_sgd", "learning_rate": LR} if kernel == "fused" else None
    return FeatureProcessedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused))


def sharded_model(
    reference: FeatureProcessedEmbeddingBagCollection,
    kind: str,
    kernel: str,
    ws: int,
    per_table: Dict | None = None,
    wrapper: DataParallelWrapper | None = None,
) -> DistributedModelParallel:
    """DMP over `Model(copy of reference)` with `ebc_cases.plan_for(kind)` (or `per_table`)."""
    fp_sharder = sharder(kernel)
    module_plan = construct_module_sharding_plan(
        reference,
        per_table or plan_for(kind, ws, ws, kernel),
        sharder=fp_sharder,
        local_size=ws,
        world_size=ws,
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD, local_world_size=ws)
    return DistributedModelParallel(
        Model(copy.deepcopy(reference)),
        env=env,
        plan=ShardingPlan({"fp": module_plan}),
        sharders=[fp_sharder],
        data_parallel_wrapper=wrapper,
    )
