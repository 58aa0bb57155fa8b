"""The input side of a sharded collection (EBC, EC and their quantized twins): one batch from
the caller's KJT to each sharding's routed ids.

Check the batch (structure, features, dtypes, weights, each table's bounds-check mode) before
any collective; a rejected batch still joins the splits exchange carrying the verdict, so every
rank raises at the first wait instead of hanging. A module with no splits exchange (every table
data-parallel) exchanges the verdict on its own (`comm/verdict.py`). The accepted batch is
permuted once into the shardings' concatenated wire order and split among them.

A variable batch per feature (TorchRec's VBE: `stride_per_key_per_rank`, `inverse_indices`)
is checked here (`check_variable_batch`) in modules that take it; the context keeps the inverse
indices and each sharding's batch sizes for the output side (`variable_batch_output.py`).

A feature several tables read (TorchRec allows it) is copied once per table first, under the
embedding names `feature@table` (`sharding/common.py`): from there on each copy is its own key,
checked against its own table's rows and bounds-check mode, routed by its table's sharding,
and returned under the unsharded module's output key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple

import torch

from recshard.comm.verdict import exchange_verdict
from recshard.lookup.fused_params import bounds_check_mode
from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.modules.embedding_tables import embedding_names
from recshard.modules.input_checks import (
    bounds_check,
    check_dtypes_and_weights,
    check_features,
    check_one_batch,
    check_variable_batch,
)
from recshard.sharding.common import EmbeddingSharding, EmbeddingShardingContext
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse.validation import validate_kjt
from recshard.types import (
    Awaitable,
    BoundsCheckMode,
    EmbeddingModuleShardingPlan,
    FnAwaitable,
    ShardingEnv,
)


@dataclass
class EmbeddingModuleContext:
    """One batch's state in a sharded collection, from `input_dist` to `output_dist`."""

    # the checked batch: the caller's keys and order, or one key per embedding name (in
    # config order) when a feature is read by several tables
    features: KeyedJaggedTensor | None = None
    sharding_contexts: List[EmbeddingShardingContext] = field(default_factory=list)  # by sharding
    # the caller's KJT had a variable batch per feature / inverse_indices (TorchRec's names)
    variable_batch_per_feature: bool = False
    inverse_indices: Tuple[List[str], torch.Tensor] | None = None

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        if self.features is not None:
            self.features.record_stream(stream)
        if self.inverse_indices is not None and self.inverse_indices[1].is_cuda:
            self.inverse_indices[1].record_stream(stream)
        for context in self.sharding_contexts:
            context.record_stream(stream)


class _ListAwaitable(Awaitable[List[Any]]):
    """Waits a list of awaitables; the result of each wait may itself be an awaitable."""

    def __init__(self, awaitables: List[Awaitable[Any]]) -> None:
        super().__init__()
        self._awaitables = awaitables

    def _wait_impl(self) -> List[Any]:
        return [a.wait() for a in self._awaitables]


class CollectionInputDist:
    """Checks and routes a collection's batches to its shardings; `owner` names the sharded
    module in errors."""

    def __init__(
        self,
        owner: str,
        env: ShardingEnv,
        device: torch.device,
        configs: List[BaseEmbeddingConfig],
        table_plans: EmbeddingModuleShardingPlan,
        default_bounds_mode: BoundsCheckMode,
        is_weighted: bool,
        shardings: List[EmbeddingSharding],
        one_batch: bool = False,
        variable_batch: bool = False,
    ) -> None:
        """`one_batch`: the module pools one batch per rank; a variable batch per feature
        (or inverse_indices) is refused before any collective. `variable_batch`: a pooled
        module that takes them (checked, then kept in the context)."""
        self._owner, self._env, self._device = owner, env, device
        self._one_batch = one_batch
        self._variable_batch = variable_batch
        self._is_weighted = is_weighted
        self._shardings = shardings
        self._feature_names = list(dict.fromkeys(f for c in configs for f in c.feature_names))
        names = embedding_names(configs)
        sources = [f for c in configs for f in c.feature_names]  # the feature each name reads
        self._copied_features = sources if names != sources else None  # None: no shared feature
        self._embedding_names = names
        tables = [(c.name, c.num_embeddings) for c in configs for _ in c.feature_names]
        self._feature_to_table = dict(zip(names, tables))  # by embedding name
        self._bounds_modes = {
            c.name: bounds_check_mode(table_plans[c.name].bounds_check_mode) or default_bounds_mode
            for c in configs
        }
        self._warned: Set[Tuple[str, str]] = set()
        self._wire_features = [f for s in shardings for f in s.input_features]
        self._wire_splits = [len(s.input_features) for s in shardings]
        self._permute_cache: Dict[Tuple[str, ...], Tuple[List[int], torch.Tensor]] = {}
        checked = {
            name: rows
            for name, (table, rows) in self._feature_to_table.items()
            if self._bounds_modes[table] != BoundsCheckMode.NONE
        }
        for sharding in shardings:  # their ids are checked before they are sent
            sharding.set_checked_rows(checked)

    def _checked(self, features: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, str | None]:
        """(the batch to route, None) or (the batch, why it is rejected)."""
        try:
            if self._variable_batch:
                check_variable_batch(features, self._owner)
                features = _one_column(features)
            validate_kjt(features)
            check_features(features, self._feature_names, self._owner)
            if self._one_batch:
                check_one_batch(features, self._owner)
            check_dtypes_and_weights(features, self._is_weighted, self._owner)
            if self._copied_features is not None:
                features = self._copy_shared_features(features)
            features = bounds_check(
                features, self._feature_to_table, self._bounds_modes, self._owner, self._warned
            )
        except ValueError as e:
            return features, str(e)
        return features, None

    def _copy_shared_features(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """One key per embedding name, in config order: a shared feature's ids once per table
        that reads it (one permute with repeated indices, as TorchRec's input dist)."""
        index = {k: i for i, k in enumerate(features.keys())}
        copied = features.permute([index[f] for f in self._copied_features])
        variable = copied.variable_stride_per_key()
        return KeyedJaggedTensor(
            self._embedding_names,
            copied.values(),
            copied.weights_or_none(),
            lengths=copied.lengths(),
            stride=copied.stride(),
            stride_per_key_per_rank=copied.stride_per_key_per_rank() if variable else None,
            length_per_key=copied.length_per_key(),
            validate=False,
        )

    def _wire_permutation(
        self, keys: List[str], device: torch.device
    ) -> Tuple[List[int], torch.Tensor]:
        """The wire order's key indices in `keys`: as a list, and as a tensor on `device` (the
        features'), built once per key order."""
        cached = self._permute_cache.get(tuple(keys))
        if cached is None or cached[1].device != device:
            index = {k: i for i, k in enumerate(keys)}
            order = [index[f] for f in self._wire_features]
            cached = (order, torch.tensor(order, dtype=torch.int32, device=device))
            self._permute_cache[tuple(keys)] = cached
        return cached

    def dist(
        self, ctx: EmbeddingModuleContext, features: KeyedJaggedTensor, rejected: str | None = None
    ) -> Awaitable[Awaitable[List[KeyedJaggedTensor]]]:
        """Check the batch, permute it into wire order once, start every sharding's dist.
        `rejected`: why a module wrapping this one refuses the batch (its own check), sent as
        this module's verdict when the batch passes its checks."""
        if self._variable_batch:
            ctx.variable_batch_per_feature = features.variable_stride_per_key()
            inverse = features.inverse_indices_or_none()
            ctx.inverse_indices = inverse if inverse is not None and inverse[1].numel() else None
        features, error = self._checked(features)
        error = error or rejected
        ctx.features = features
        if error is None:
            stride_of = dict(zip(features.keys(), features.stride_per_key()))
            for s, sharding_ctx in zip(self._shardings, ctx.sharding_contexts):
                sharding_ctx.batch_size_per_feature_pre_a2a = [
                    stride_of[f] for f in s.input_features
                ]
        in_order = None  # one sharding routing the keys in wire order without a permute
        if error is None and features.keys() != self._wire_features:  # else: no copy
            order, permutation = self._wire_permutation(features.keys(), features.device())
            if len(self._shardings) == 1:
                in_order = self._shardings[0].input_dist_in_order(
                    features, order, ctx.sharding_contexts[0]
                )
            if in_order is None:
                features = features.permute(order, permutation)
        if error is None:
            parts = features.split(self._wire_splits) if len(self._wire_splits) > 1 else [features]
        else:
            parts = [placeholder_kjt(s.input_features, self._device) for s in self._shardings]
        verdict = None  # no splits exchange carries the verdict: exchange it on its own
        if not any(s.carries_input_error for s in self._shardings):
            verdict = exchange_verdict(self._env.pg, error, self._device)
            if verdict is None and error is not None:
                raise ValueError(error)
        splits = _ListAwaitable(
            [in_order]
            if in_order is not None
            else [
                s.input_dist(part, sharding_ctx, error)
                for s, sharding_ctx, part in zip(self._shardings, ctx.sharding_contexts, parts)
            ]
        )

        def start_tensors() -> Awaitable[List[KeyedJaggedTensor]]:
            if verdict is not None:
                verdict.wait()
            tensors = splits.wait()
            # every rank's batch size, learned in the splits exchange (unequal batches work)
            sizes = next(
                (t.stride_per_rank for t in tensors if hasattr(t, "stride_per_rank")), None
            )
            if sizes is not None and len(set(sizes)) > 1:
                for sharding_ctx in ctx.sharding_contexts:
                    sharding_ctx.batch_size_per_rank = list(sizes)
            return _RoutedAwaitable(tensors, ctx.sharding_contexts, self._env.world_size)

        return FnAwaitable(start_tensors)


class _RoutedAwaitable(Awaitable[List[KeyedJaggedTensor]]):
    """Waits each sharding's routed ids; notes in its context whether they came with a
    variable batch per feature, and then each source rank's batch sizes (`[W][F_local]`)."""

    def __init__(
        self,
        awaitables: List[Awaitable[KeyedJaggedTensor]],
        contexts: List[EmbeddingShardingContext],
        world_size: int,
    ) -> None:
        super().__init__()
        self._awaitables, self._contexts, self._world_size = awaitables, contexts, world_size

    def _wait_impl(self) -> List[KeyedJaggedTensor]:
        routed = [a.wait() for a in self._awaitables]
        for kjt, sharding_ctx in zip(routed, self._contexts):
            if kjt.variable_stride_per_key():
                per_key = kjt.stride_per_key_per_rank()
                ranks = len(per_key[0]) if per_key else self._world_size
                sharding_ctx.variable_batch_per_feature = True
                sharding_ctx.batch_size_per_rank_per_feature = [
                    [row[r] for row in per_key] for r in range(ranks)
                ]
        return routed


def _one_column(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A variable-batch KJT with one batch size per feature (`[[B_f]]`): the layout this
    rank's own batch has, whatever columns the caller's `stride_per_key_per_rank` had."""
    rows = features.stride_per_key_per_rank()
    if not features.variable_stride_per_key() or all(len(row) == 1 for row in rows):
        return features
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        features.weights_or_none(),
        lengths=features.lengths(),
        stride_per_key_per_rank=[[sum(row)] for row in rows],
        inverse_indices=features.inverse_indices_or_none(),
        validate=False,
    )


def placeholder_kjt(keys: List[str], device: torch.device) -> KeyedJaggedTensor:
    """An empty batch with these keys on `device` (the module's): lets a rejecting rank join
    an all-to-all (the splits exchange, a managed-collision remap's)."""
    return KeyedJaggedTensor(
        keys,
        torch.empty(0, dtype=torch.int64, device=device),
        lengths=torch.zeros(0, dtype=torch.int32, device=device),
        stride=0,
        validate=False,
    )
