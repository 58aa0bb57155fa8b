"""TorchRec's sharder bases for a user's own sharder: `BaseEmbeddingSharder` (recshard's
collection sharders derive from it) with TorchRec's default sharding types and recshard's
kernels; a subclass sharding an EBC inside DMP (planned by recshard's planner from those
defaults) equals the unsharded EBC. `BaseQuantEmbeddingSharder`: table-, row- and
column-wise with the quant kernel, the tables of the module's state (`shardable_params`
limits them; an unknown name is refused)."""

from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch
from ebc_cases import batch, make_ebc
from multiprocess import run_ranks
from torch import nn

from recshard import EmbeddingBagCollection
from recshard.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recshard.distributed.embedding_types import BaseEmbeddingSharder, BaseQuantEmbeddingSharder
from recshard.quant import quantize_embeddings
from recshard.types import ShardedModule, ShardingEnv

TORCHREC_CPU_TYPES = ["data_parallel", "table_wise", "column_wise", "table_column_wise"]


class MySharder(BaseEmbeddingSharder[EmbeddingBagCollection]):
    @property
    def module_type(self) -> type:
        return EmbeddingBagCollection

    def shardable_parameters(self, module: EmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        return {name: bag.weight for name, bag in module.embedding_bags.items()}

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedModule:
        return ShardedEmbeddingBagCollection(module, params, env, device, self.fused_params)


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = make_ebc(weighted=False)

    def forward(self, features):  # noqa: ANN001, ANN201
        return self.ebc(features).values()


def planned_by_defaults(rank: int, ws: int) -> List[str]:
    reference = Wrapper()
    sharder = MySharder(fused_params={"optimizer": "exact_sgd", "learning_rate": 0.1})
    dmp = DistributedModelParallel(copy.deepcopy(reference), sharders=[sharder])
    kjt = batch(rank, 0, 3, False, False)
    torch.testing.assert_close(dmp(kjt), reference(kjt))
    return sorted({ps.sharding_type for ps in dmp.plan.get_plan_for_module("ebc").values()})


def test_a_user_sharder_on_the_base_shards_as_torchrec_defaults_say() -> None:
    sharder = MySharder()
    assert sharder.sharding_types("cpu") == TORCHREC_CPU_TYPES
    assert set(sharder.sharding_types("cuda")) == {
        *TORCHREC_CPU_TYPES,
        "row_wise",
        "table_row_wise",
    }
    assert sharder.compute_kernels("data_parallel", "cpu") == ["dense"]
    assert "fused" in sharder.compute_kernels("table_wise", "cpu")
    weight = torch.empty(10, 4)
    assert sharder.storage_usage(weight, "cpu", "fused") == {"ddr": 160}
    assert sharder.storage_usage(weight, "cuda", "fused") == {"hbm": 160}
    assert sharder.storage_usage(weight, "cuda", "fused_uvm_caching") == {"ddr": 160}
    for collection_sharder in (EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()):
        assert isinstance(collection_sharder, BaseEmbeddingSharder)
    for types in run_ranks(2, planned_by_defaults, timeout=180):
        assert set(types) <= set(TORCHREC_CPU_TYPES), types


class MyQuantSharder(BaseQuantEmbeddingSharder[nn.Module]):
    @property
    def module_type(self) -> type:
        return nn.Module

    def shard(self, module, params, env, device=None):  # noqa: ANN001, ANN201
        raise NotImplementedError  # not sharded here: the base's own behaviour is the point


def test_quant_sharder_base() -> None:
    qebc = quantize_embeddings(make_ebc(weighted=False), dtype=torch.qint8, inplace=False)
    names = sorted(c.name for c in qebc.embedding_bag_configs())
    sharder = MyQuantSharder(fused_params={"x": [1]})
    assert sharder.sharding_types("cpu") == ["table_wise", "row_wise", "column_wise"]
    assert sharder.compute_kernels("row_wise", "cpu") == ["quant"]
    tables = sharder.shardable_parameters(qebc)
    assert sorted(tables) == names
    assert all(
        torch.equal(tables[t], qebc.state_dict()[f"embedding_bags.{t}.weight"]) for t in names
    )
    assert sorted(MyQuantSharder(shardable_params=["t1"]).shardable_parameters(qebc)) == ["t1"]
    with pytest.raises(ValueError, match=r"shardable_params \['t9'\].*tables: \['t0'"):
        MyQuantSharder(shardable_params=["t9"]).shardable_parameters(qebc)
