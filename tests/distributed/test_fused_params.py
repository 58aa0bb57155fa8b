"""Fused params are parsed once per table into `FusedParams` (TorchRec's dict stays the public
input): every field read, defaults as before, and a bad value raises naming the table, at the
sharder, on every rank, before any kernel or collective."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from multiprocess import run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recshard.lookup.fused_params import FusedOptimSpec, FusedParams, OptimType
from recshard.types import ShardingEnv


def test_parse_reads_every_field() -> None:
    parsed = FusedParams.parse(
        {
            "optimizer": "exact_adagrad",
            "learning_rate": 0.5,
            "eps": 1e-6,
            "cache_load_factor": 0.25,
            "ssd_storage_directory": "/tmp/kv",
        },
        "t0",
    )
    assert parsed == FusedParams(
        FusedOptimSpec(OptimType.EXACT_ADAGRAD, 0.5, eps=1e-6), 0.25, "/tmp/kv"
    )
    assert FusedParams.parse(None, "t0") == FusedParams()  # exact SGD, learning rate 0.01
    assert FusedParams.parse({"output_dtype": torch.float32}, "t0") == FusedParams()
    assert FusedParams().optim == FusedOptimSpec(OptimType.EXACT_SGD, 0.01)


@pytest.mark.parametrize(
    "fused, message",
    [
        ({"optimizer": "lamb"}, "table 't0': fused optimizer 'lamb' is not supported"),
        ({"weight_decay": 0.1}, "table 't0': fused weight_decay is not supported"),
        ({"learning_rate": "fast"}, "table 't0': fused param learning_rate='fast' is not a number"),
        ({"output_dtype": "FP16"}, "table 't0': fused param output_dtype='FP16' is not supported"),
    ],
)
def test_bad_fused_params_name_the_table(fused: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FusedParams.parse(fused, "t0")


def _shard_with(rank: int, ws: int, fused: Dict[str, Any]) -> str:
    tables = [
        EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(2)
    ]
    module = EmbeddingBagCollection(tables)
    plan = construct_module_sharding_plan(
        module, {"t0": table_wise(0), "t1": table_wise(ws - 1)}, world_size=ws
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    try:
        EmbeddingBagCollectionSharder(fused_params=fused).shard(module, plan, env)
    except ValueError as e:
        return str(e)
    return "no error"


def test_sharder_refuses_a_bad_optimizer_on_every_rank() -> None:
    messages: List[str] = run_ranks(2, _shard_with, {"optimizer": "lamb"})
    for message in messages:
        assert "table 't0': fused optimizer 'lamb' is not supported" in message, message
