"""Data-parallel sharding: every rank holds the whole table and looks up its own batch.

No input or output dist. The replicas stay equal because each weight gradient is averaged
over ranks (all-reduce / world size, the DDP rule) by a hook as soon as it is computed;
DistributedModelParallel leaves these weights out of its own DDP wrapper.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from recshard.lookup.grouped import GroupedLookup, lookup_order
from recshard.sharding.common import EmbeddingSharding, TableSpec
from recshard.sparse import KeyedJaggedTensor
from recshard.types import Awaitable, EmbeddingComputeKernel, NoWait, ShardingEnv


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
        if env.world_size > 1:
            for weight in self.lookup.table_weights():
                weight.register_hook(self._average_over_ranks)

    def after_init(self) -> None:
        """Replicas start equal: rank 0's weights win (ranks may have drawn different inits)."""
        if self.env.world_size > 1:
            with torch.no_grad():
                for weight in self.lookup.table_weights():
                    dist.broadcast(weight.data, src=dist.get_global_rank(self.env.pg, 0)
                                   if self.env.pg is not None else 0, group=self.env.pg)

    def _average_over_ranks(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad / self.env.world_size
        dist.all_reduce(grad, group=self.env.pg)
        return grad

    def input_dist(
        self, features: KeyedJaggedTensor, ctx: Dict[str, Any], input_error: Optional[str]
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        # A rejected input is raised by the sharded module (no collective to carry it here).
        return NoWait(NoWait(features))

    def output_dist(self, local: torch.Tensor, ctx: Dict[str, Any]) -> Awaitable[torch.Tensor]:
        return NoWait(local)
