"""Data-parallel sharding: every rank holds the whole table and looks up its own batch.

No input or output dist. The replicas stay equal because each weight gradient is averaged
over ranks (all-reduce / world size, the DDP rule) in backward, as soon as it is computed;
DistributedModelParallel leaves these weights out of its own DDP wrapper. For tables of
`ROW_EXCHANGE_MIN_BYTES` or more the all-reduce carries only the rows some rank looked up
(`average_rows_over_ranks`): same result, a fraction of the bytes when a step touches a
fraction of the table.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from recshard.comm.row_average import average_rows_over_ranks
from recshard.lookup.grouped import GroupedLookup, lookup_order
from recshard.sharding.common import EmbeddingSharding, TableSpec
from recshard.sparse import KeyedJaggedTensor
from recshard.types import Awaitable, EmbeddingComputeKernel, NoWait, ShardingEnv

# Tables whose gradient is smaller than this are averaged with one plain all-reduce: for them
# the extra collective that agrees on the rows in use costs more than the bytes it saves.
ROW_EXCHANGE_MIN_BYTES = 4 << 20


class _AverageGradOverRanks(torch.autograd.Function):
    """Identity on a table's weight; backward averages its gradient over ranks, sending only
    the rows some rank looked up (`ids` are this rank's; None: every row). One node per
    forward, so gradient accumulation over several forwards averages each part, which sums
    to the right mean."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: Optional[torch.Tensor],  # noqa: ANN001
                pg: Optional[dist.ProcessGroup]) -> torch.Tensor:
        ctx.ids, ctx.pg = ids, pg
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        # In place: the lookup's weight gradient is a fresh tensor that nothing else holds.
        if ctx.ids is None:
            dist.all_reduce(grad, group=ctx.pg)
            return grad.div_(dist.get_world_size(ctx.pg)), None, None
        return average_rows_over_ranks(grad, ctx.ids, ctx.pg), None, None


class DataParallelPooledSharding(EmbeddingSharding):
    carries_input_error = False

    def __init__(
        self, specs: List[TableSpec], env: ShardingEnv, device: torch.device, is_weighted: bool,
        pooled: bool = True,
    ) -> None:
        super().__init__(env)
        for spec in specs:
            if spec.kernel != EmbeddingComputeKernel.DENSE:
                raise ValueError(
                    f"table '{spec.config.name}': data_parallel sharding takes the 'dense' "
                    f"kernel (replicas are averaged like dense parameters), got '{spec.kernel.value}'"
                )
        tables = lookup_order([s.whole_table() for s in specs], is_weighted)
        self.input_features = [f for t in tables for f in t.feature_names]
        self.output_columns = [(f, 0, t.cols) for t in tables for f in t.feature_names]
        self.lookup = GroupedLookup(tables, pooled, device, is_weighted)
        self._row_exchange_min_bytes = ROW_EXCHANGE_MIN_BYTES
        if env.world_size > 1:
            for kernel in self.lookup.kernels:
                kernel.weight_in_use = self._averaged_in_backward

    def after_init(self) -> None:
        """Replicas start equal: rank 0's weights win (ranks may have drawn different inits)."""
        if self.env.world_size > 1:
            with torch.no_grad():
                for weight in self.lookup.table_weights():
                    dist.broadcast(weight.data, src=dist.get_global_rank(self.env.pg, 0)
                                   if self.env.pg is not None else 0, group=self.env.pg)

    def _averaged_in_backward(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        exchange_rows = weight.numel() * weight.element_size() >= self._row_exchange_min_bytes
        return _AverageGradOverRanks.apply(weight, ids if exchange_rows else None, self.env.pg)

    def input_dist(
        self, features: KeyedJaggedTensor, ctx: Dict[str, Any], input_error: Optional[str]
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        # A rejected input is raised by the sharded module (no collective to carry it here).
        return NoWait(NoWait(features))

    def output_dist(self, local: torch.Tensor, ctx: Dict[str, Any]) -> Awaitable[torch.Tensor]:
        return NoWait(local)
