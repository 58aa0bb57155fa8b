"""A DLRM training script written for TorchRec, in the shape of its examples/golden_training
(random data, DLRM, DistributedModelParallel, TrainPipelineSparseDist). The port test rewrites
its imports to recshard's and runs it."""

import os
from typing import List, Optional

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import distributed as dist
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter


def train(
    num_embeddings: int = 1000,
    embedding_dim: int = 8,
    dense_arch_layer_sizes: Optional[List[int]] = None,
    over_arch_layer_sizes: Optional[List[int]] = None,
    learning_rate: float = 0.1,
    num_iterations: int = 20,
) -> float:
    dense_arch_layer_sizes = dense_arch_layer_sizes or [16, embedding_dim]
    over_arch_layer_sizes = over_arch_layer_sizes or [16, 1]
    device = torch.device("cpu")
    dist.init_process_group(backend="gloo")

    # one table per categorical feature, built on meta: DMP materializes the shards
    tables = [
        EmbeddingBagConfig(
            name=f"t_{feature_name}",
            embedding_dim=embedding_dim,
            num_embeddings=num_embeddings,
            feature_names=[feature_name],
        )
        for feature_name in DEFAULT_CAT_NAMES
    ]
    dlrm_model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=dense_arch_layer_sizes,
        over_arch_layer_sizes=over_arch_layer_sizes,
        dense_device=device,
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": learning_rate}
    )
    model = DistributedModelParallel(module=DLRMTrain(dlrm_model), device=device, sharders=[sharder])
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=learning_rate),
    )
    pipeline = TrainPipelineSparseDist(model, dense_optimizer, device)
    batches = iter(
        RandomRecDataset(
            keys=DEFAULT_CAT_NAMES,
            batch_size=32,
            hash_size=num_embeddings,
            ids_per_feature=1,
            num_dense=len(DEFAULT_INT_NAMES),
            manual_seed=int(os.environ.get("RANK", "0")),
            num_batches=num_iterations,
        )
    )
    loss = float("nan")
    while True:
        try:
            loss, _logits, _labels = pipeline.progress(batches)
        except StopIteration:
            break
    dist.destroy_process_group()
    return float(loss)


if __name__ == "__main__":
    print(f"final loss {train():.4f}")
