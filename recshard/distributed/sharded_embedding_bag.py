"""ShardedEmbeddingBag: a plain `torch.nn.EmbeddingBag` sharded inside DMP, and its sharder.

The bag is sharded as a one-table `EmbeddingBagCollection` (`EmbeddingBagView`: table
`weight`, feature `input`), by every sharding type the collection supports (TorchRec refuses
table-wise). `forward(input, offsets=None, per_sample_weights=None)` takes what the bag takes
(a 1-D input with offsets, honouring `include_last_offset`, or a 2-D `[B, L]` input) and
returns the bag's `[B, D]`: the ids become a one-feature KJT (ids equal to `padding_idx`
dropped, as the bag skips them), the sharded collection looks them up, its output's values are
the result. Options that change the numbers and that the kernels do not run (`max_norm`,
`scale_grad_by_freq`, mode 'max') are refused when the bag is sharded.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from recshard.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.modules.embedding_bag_view import BAG_FEATURE, BAG_TABLE, EmbeddingBagView
from recshard.sparse import KeyedJaggedTensor, KeyedTensor
from recshard.types import Awaitable, EmbeddingModuleShardingPlan, LazyAwaitable, ShardingEnv


def _refuse_unsupported(bag: nn.EmbeddingBag) -> None:
    if bag.max_norm is not None:
        raise ValueError(
            f"nn.EmbeddingBag(max_norm={bag.max_norm}) cannot be sharded: the sharded kernels "
            "do not renormalize rows"
        )
    if bag.scale_grad_by_freq:
        raise ValueError(
            "nn.EmbeddingBag(scale_grad_by_freq=True) cannot be sharded: the sharded kernels "
            "do not scale gradients by id frequency"
        )


class ShardedEmbeddingBag(ShardedEmbeddingBagCollection):
    """Sharded twin of `nn.EmbeddingBag`, built by `EmbeddingBagSharder` (TorchRec's argument
    order). Its state_dict key, parameter and fused optimizer state are named `weight`, as
    the bag names its weight."""

    def __init__(
        self,
        module: nn.EmbeddingBag,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        fused_params: Dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        _refuse_unsupported(module)
        super().__init__(
            EmbeddingBagView(module),
            table_name_to_parameter_sharding,
            env,
            device,
            fused_params,
            qcomm_codecs_registry,
        )
        self._mode = module.mode
        self._padding_idx = module.padding_idx
        self._include_last_offset = module.include_last_offset

    def table_key(self, table: str) -> str:
        return BAG_TABLE

    def forward(  # type: ignore[override]
        self,
        input: torch.Tensor,  # noqa: A002 - nn.EmbeddingBag's name
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> LazyAwaitable[torch.Tensor]:
        ctx = self.create_context()
        dist_input = self.input_dist(ctx, input, offsets, per_sample_weights).wait().wait()
        return self.compute_and_output_dist(ctx, dist_input)

    def input_dist(  # type: ignore[override]
        self,
        ctx: EmbeddingModuleContext,
        input: torch.Tensor,  # noqa: A002
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> Awaitable[Awaitable[List[KeyedJaggedTensor]]]:
        """The bag's arguments as a one-feature KJT; a refusal reaches every rank."""
        try:
            features, rejected = self._features(input, offsets, per_sample_weights), None
        except ValueError as e:
            features, rejected = self._no_bags(input.device), str(e)
        return super().input_dist(ctx, features, rejected)

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[torch.Tensor]:  # type: ignore[override]
        """The pooled bags `[B, D]`."""
        pooled = super().output_dist(ctx, output)
        pooled.callbacks.append(KeyedTensor.values)
        return pooled  # type: ignore[return-value]

    def _no_bags(self, device: torch.device) -> KeyedJaggedTensor:
        weights = torch.empty(0, device=device) if self.is_weighted() else None
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return KeyedJaggedTensor([BAG_FEATURE], empty, weights, lengths=empty.int())

    def _features(
        self, ids: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None
    ) -> KeyedJaggedTensor:
        ids, lengths, weights = self._bags(ids, offsets, weights)
        if self._padding_idx is not None:
            keep = ids != self._padding_idx
            if not bool(keep.all()):
                bag = torch.repeat_interleave(
                    torch.arange(lengths.numel(), device=ids.device), lengths
                )
                lengths = torch.zeros_like(lengths).index_add_(0, bag, keep.to(lengths.dtype))
                ids = ids[keep]
                weights = None if weights is None else weights[keep]
        if self.is_weighted() and weights is None:
            weights = torch.ones(ids.numel(), dtype=torch.float32, device=ids.device)
        return KeyedJaggedTensor([BAG_FEATURE], ids, weights, lengths=lengths)

    def _bags(
        self, ids: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(ids, bag lengths, weights), flat, checked as `nn.EmbeddingBag` checks them."""
        what = "ShardedEmbeddingBag"
        if weights is not None:
            if self._mode != "sum":
                raise ValueError(
                    f"{what}: per_sample_weights need mode 'sum' (as nn.EmbeddingBag), "
                    f"this bag's is {self._mode!r}"
                )
            if tuple(weights.shape) != tuple(ids.shape):
                raise ValueError(
                    f"{what}: per_sample_weights of shape {tuple(weights.shape)} for an input "
                    f"of shape {tuple(ids.shape)} (they must match)"
                )
            weights = weights.reshape(-1)
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError(f"{what}: a 2-D input [B, L] takes no offsets")
            batch, length = ids.shape
            lengths = torch.full((batch,), length, dtype=torch.int64, device=ids.device)
            return ids.reshape(-1), lengths, weights
        if ids.dim() != 1 or offsets is None or offsets.dim() != 1:
            raise ValueError(
                f"{what}: input must be 2-D [B, L], or 1-D with 1-D offsets; got input of "
                f"shape {tuple(ids.shape)} and offsets "
                f"{None if offsets is None else tuple(offsets.shape)}"
            )
        if offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what}: offsets must be int32 or int64, got {offsets.dtype}")
        ends = [] if self._include_last_offset else [ids.numel()]
        bounds = torch.cat(
            [offsets.long(), torch.tensor(ends, dtype=torch.int64, device=offsets.device)]
        )
        if bounds.numel() == 0 or int(bounds[0]) != 0:
            raise ValueError(f"{what}: offsets must start at 0, got {offsets[:4].tolist()}")
        lengths = bounds.diff()
        if bool((lengths < 0).any()) or int(bounds[-1]) != ids.numel():
            raise ValueError(
                f"{what}: offsets must not decrease and must end at the input's "
                f"{ids.numel()} ids (include_last_offset={self._include_last_offset}); got "
                f"{offsets.tolist()[:8]}"
            )
        return ids, lengths, weights


class EmbeddingBagSharder(EmbeddingBagCollectionSharder):
    """Shards a plain `nn.EmbeddingBag` (TorchRec's `EmbeddingBagSharder`) as the collection
    sharder shards its view; its plan is `{"weight": ParameterSharding}`. Not among DMP's
    default sharders, as in TorchRec."""

    sharded_type = ShardedEmbeddingBag

    @property
    def module_type(self) -> type:
        return nn.EmbeddingBag

    def shardable_parameters(self, module: nn.EmbeddingBag) -> Dict[str, nn.Parameter]:
        return {BAG_TABLE: module.weight}

    def shard(
        self,
        module: nn.EmbeddingBag,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedEmbeddingBag:
        return ShardedEmbeddingBag(
            module, params, env, self.fused_params, device, self.qcomm_codecs_registry
        )
