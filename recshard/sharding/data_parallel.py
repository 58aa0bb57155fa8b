"""Data-parallel sharding: every rank holds the whole table and looks up its own batch.

No input or output dist. The replicas stay equal because each weight gradient is averaged
over ranks (all-reduce / world size, the DDP rule) in backward, as soon as it is computed;
DistributedModelParallel leaves these weights out of its own DDP wrapper. For tables of
`ROW_EXCHANGE_MIN_BYTES` or more the all-reduce carries only the rows some rank looked up
(`average_rows_over_ranks`): same result, a fraction of the bytes when a step touches a
fraction of the table. Smaller tables share one all-reduce per lookup kernel.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from recshard.comm.row_average import average_rows_over_ranks
from recshard.lookup.grouped import GroupedLookup, lookup_order
from recshard.sharding.common import (
    EmbeddingSharding,
    EmbeddingShardingContext,
    LookupFactory,
    TableSpec,
)
from recshard.sparse import KeyedJaggedTensor
from recshard.types import (
    ROW_EXCHANGE_MIN_BYTES,
    Awaitable,
    EmbeddingComputeKernel,
    NoWait,
    ShardingEnv,
)


class _AverageGradsOverRanks(torch.autograd.Function):
    """Identity on a kernel's table weights; backward averages their gradients over ranks.
    Tables given `ids` (this rank's looked-up rows) send only the rows some rank looked up;
    the others are flattened into one buffer and all-reduced together. One node per forward,
    so gradient accumulation over several forwards averages each part, which sums to the
    right mean."""

    @staticmethod
    def forward(
        ctx,
        pg: dist.ProcessGroup | None,
        ids: List[torch.Tensor | None],  # noqa: ANN001
        *weights: torch.Tensor,
    ) -> Tuple[torch.Tensor, ...]:
        ctx.pg, ctx.ids = pg, ids
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: ANN001, ANN205
        world_size = dist.get_world_size(ctx.pg)
        out = list(grads)
        together = [i for i, ids in enumerate(ctx.ids) if ids is None]
        if together:
            flat = torch.cat([grads[i].reshape(-1) for i in together])
            dist.all_reduce(flat, group=ctx.pg)
            flat.div_(world_size)
            for i, part in zip(together, flat.split([grads[i].numel() for i in together])):
                out[i] = part.view_as(grads[i])
        for i, ids in enumerate(ctx.ids):
            if ids is not None:  # in place: a lookup's weight gradient is a fresh tensor
                out[i] = average_rows_over_ranks(grads[i], ids, ctx.pg)
        return (None, None, *out)


class DataParallelPooledSharding(EmbeddingSharding):
    carries_input_error = False

    def __init__(
        self,
        specs: List[TableSpec],
        env: ShardingEnv,
        device: torch.device,
        is_weighted: bool,
        pooled: bool = True,
        make_lookup: LookupFactory = GroupedLookup,
    ) -> None:
        """Trainable replicas take the 'dense' kernel (averaged like dense parameters); the
        quantized inference modules' replicas take 'quant' (nothing to average)."""
        super().__init__(env)
        for spec in specs:
            if spec.kernel not in (EmbeddingComputeKernel.DENSE, EmbeddingComputeKernel.QUANT):
                raise ValueError(
                    f"table '{spec.config.name}': data_parallel sharding takes the 'dense' "
                    "kernel (replicas are averaged like dense parameters), "
                    f"got '{spec.kernel.value}'"
                )
        tables = lookup_order([s.whole_table() for s in specs], is_weighted)
        self.input_features = [f for t in tables for f in t.embedding_names]
        self.output_columns = [(f, 0, t.cols) for t in tables for f in t.embedding_names]
        self.lookup = make_lookup(tables, pooled, device, is_weighted)
        self._row_exchange_min_bytes = ROW_EXCHANGE_MIN_BYTES
        if env.world_size > 1 and all(s.kernel == EmbeddingComputeKernel.DENSE for s in specs):
            for kernel in self.lookup.kernels:
                kernel.weights_in_use = self._averaged_in_backward

    def after_init(self) -> None:
        """Replicas start equal: rank 0's weights win (ranks may have drawn different inits)."""
        if self.env.world_size > 1:
            with torch.no_grad():
                for weight in self.lookup.table_weights():
                    dist.broadcast(
                        weight.data,
                        src=dist.get_global_rank(self.env.pg, 0) if self.env.pg is not None else 0,
                        group=self.env.pg,
                    )

    def _averaged_in_backward(
        self, weights: List[torch.Tensor], ids: List[torch.Tensor]
    ) -> List[torch.Tensor]:
        exchange = [
            table_ids if w.numel() * w.element_size() >= self._row_exchange_min_bytes else None
            for w, table_ids in zip(weights, ids)
        ]
        return list(_AverageGradsOverRanks.apply(self.env.pg, exchange, *weights))

    def input_dist(
        self, features: KeyedJaggedTensor, ctx: EmbeddingShardingContext, input_error: str | None
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        # A rejected input is raised by the sharded module (no collective to carry it here).
        return NoWait(NoWait(features))

    def output_dist(
        self, local: torch.Tensor, ctx: EmbeddingShardingContext
    ) -> Awaitable[torch.Tensor]:
        return NoWait(local)
