"""Tensor-parallel over arch (`--tp-over-arch`): the over arch's first two layers as a
column-parallel -> row-parallel pair (`recshard.parallel`), run on the global batch.

Every rank's interaction output is all-gathered along the batch, so all ranks feed the same
`[W*B, D]` into the pair (tensor parallelism needs identical inputs); the loss is taken over
the global batch on every rank. Gradients: the pair's shards get complete gradients (they
stay out of DDP); the gradient flowing back into each rank's own rows is scaled by W, so the
data-parallel parts upstream — averaged over ranks by DDP and the embedding output dists —
receive the same full-batch gradient as without tensor parallelism. Same objective, same
updates: the mean loss over the global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.dlrm.model import ExampleDLRMTrain
from recshard.models.dlrm import OverArch
from recshard.parallel import ColumnParallelLinear, RowParallelLinear, mp_gather


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times `scale` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad * ctx.scale, None


def _world(pg: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(pg) if dist.is_initialized() else 1


class TensorParallelOverArch(nn.Module):
    """`[B, D]` on each rank -> logits `[W*B, 1]` for the global batch, identical on all ranks."""

    def __init__(self, over_arch: OverArch, pg: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        linears = over_arch.linears()  # a ReLU follows each but the last
        if len(linears) < 2:
            raise ValueError(
                "--tp-over-arch needs an over arch of at least two layers "
                "(e.g. --over-arch-layers 64,32,1)"
            )
        if dist.is_initialized():  # slices of one matrix: rank 0's full weights for everyone
            with torch.no_grad():
                for layer in linears[:2]:
                    for param in layer.parameters():
                        dist.broadcast(
                            param, src=dist.get_global_rank(pg or dist.group.WORLD, 0), group=pg
                        )
        self.pg = pg
        self.column = ColumnParallelLinear.from_linear(linears[0], pg, gather_output=False)
        self.activation = nn.ReLU()
        self.row = RowParallelLinear.from_linear(linears[1], pg, input_is_parallel=True)
        self.rest = nn.Sequential(*[m for linear in linears[2:] for m in (nn.ReLU(), linear)])

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        world = _world(self.pg)
        everyone = mp_gather(_ScaleGrad.apply(features, float(world)), 0, self.pg)
        return self.rest(self.row(self.activation(self.column(everyone))))


class GlobalBatch(nn.Module):
    """Labels of every rank's batch (rank order, no gradient), and this rank's rows back."""

    def __init__(self, pg: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.pg = pg

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        if _world(self.pg) == 1:
            return labels
        parts = [torch.empty_like(labels) for _ in range(_world(self.pg))]
        dist.all_gather(parts, labels.contiguous(), group=self.pg)
        return torch.cat(parts)

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
        world = _world(self.pg)
        rank = dist.get_rank(self.pg) if world > 1 else 0
        batch = rows.size(0) // world
        return rows.narrow(0, rank * batch, batch)


def to_tensor_parallel(model: ExampleDLRMTrain, pg: dist.ProcessGroup | None = None) -> None:
    """Switch a (materialized) DLRMTrain to the tensor-parallel over arch, in place. Call it
    on every rank, before the dense part is wrapped in DDP (`DistributedModelParallel(...,
    init_data_parallel=False)`, then `dmp.init_data_parallel()`)."""
    model.model.over_arch = TensorParallelOverArch(model.model.over_arch, pg)
    model.global_batch = GlobalBatch(pg)
