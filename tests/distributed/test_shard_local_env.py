"""`shard_modules` with `ShardingEnv.from_local(1, 0)` and no process group (TorchRec's
tutorial shards its quantized EBC this way): the planner plans locally, as TorchRec does when
the env has no process group, and the sharded module gives the unsharded numbers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed.shard import shard_modules
from recshard.quant import quantize_embeddings
from recshard.types import ShardingEnv


def test_quantized_ebc_shards_on_a_local_env_without_a_process_group() -> None:
    assert not dist.is_initialized()
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=8, num_embeddings=20, feature_names=[f])
        for t, f in [("t0", "f0"), ("t1", "f1")]
    ]
    model = quantize_embeddings(torch.nn.Sequential(EmbeddingBagCollection(configs)), torch.qint8)
    features = KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], torch.tensor([1, 5, 7, 19, 0, 9]), torch.tensor([2, 1, 0, 3])
    )
    expected = model(features).values()
    sharded = shard_modules(
        module=model, device=torch.device("cpu"), env=ShardingEnv.from_local(1, 0)
    )
    assert torch.equal(sharded(features).values(), expected)
