"""TrainPipelineSparseDist over a sharded managed collision EBC equals the plain loop: the
pipeline starts a batch's id routing (input_dist) while the previous batch trains; remapping,
counting and eviction stay in compute, in batch order."""

from __future__ import annotations

from typing import List, Tuple

import torch
from dmp_cases import make_optimizer
from mc_cases import LR, SparseModel, kjt_of, local_ids
from multiprocess import run_ranks
from pipeline_cases import Batch
from torch import nn

from recshard.distributed import DistributedModelParallel, TrainPipelineSparseDist
from recshard.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

STEPS = 8


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse_model = SparseModel(6)
        self.head = nn.Linear(11, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.linspace(-1, 1, 11))
            self.head.bias.zero_()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.sparse_model(batch.sparse_features))
        return out.sum(), out.detach()


def _batches(rank: int) -> List[Batch]:
    return [
        Batch(torch.zeros(4, 3), kjt_of([local_ids(step, rank)]), torch.zeros(4), index=step)
        for step in range(STEPS)
    ]


def _dmp() -> DistributedModelParallel:
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LR}
    )
    return DistributedModelParallel(_Model(), sharders=[sharder])


def _pipeline_vs_loop(rank: int, ws: int) -> List[str]:
    plain, piped = _dmp(), _dmp()
    plain_opt = make_optimizer(plain, fused=True, adagrad=False)
    want = []
    for batch in _batches(rank):
        plain_opt.zero_grad()
        loss, out = plain(batch)
        loss.backward()
        plain_opt.step()
        want.append(out)
    pipeline = TrainPipelineSparseDist(
        piped, make_optimizer(piped, True, False), torch.device("cpu")
    )
    batches = iter(_batches(rank))
    got = []
    for _ in range(STEPS):
        got.append(pipeline.progress(batches))  # the model output of that batch
    return [
        f"step {k}: outputs differ by {(g - w).abs().max():.3g}"
        for k, (g, w) in enumerate(zip(got, want))
        if not torch.allclose(g, w, atol=1e-6)
    ]


def test_pipeline_equals_plain_loop() -> None:
    for rank, problems in enumerate(run_ranks(2, _pipeline_vs_loop, timeout=180)):
        assert not problems, f"rank {rank}: {problems}"
