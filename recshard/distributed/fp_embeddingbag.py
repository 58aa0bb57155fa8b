"""ShardedFeatureProcessedEmbeddingBagCollection: a sharded EBC whose ids are weighted by
feature processors, and its sharder.

    input_dist:  check bag lengths; weights := each id's position in its bag (float); the
                 sharded EBC's input dist carries them with the ids to the ranks that own
                 the rows (row-wise sharding splits bags, so positions travel rather than
                 being recomputed there)
    compute:     weights := position_weight[feature][position] (other processors: applied to
                 the routed bags) -> the sharded EBC's lookups
    output_dist: the sharded EBC's, plus a zero term over every processor parameter, so each
                 rank's backward reaches all of them (DDP's all-reduce order stays the same)

The processors' parameters are ordinary dense parameters: replicated, averaged by DDP and
stepped by the dense optimizer, saved as plain tensors. Gradient convention: their update
uses the mean over ranks of the per-rank gradients, like every other parameter. A rank that
looks up another rank's ids receives their output gradient divided by the world size (the
output dist's convention); the weights' gradient is multiplied back before DDP averages it.

Every sharding type of the EBC sharder works with position weights (TorchRec leaves row-wise
out). Processors other than position weights see each bag's ids, so their tables cannot be
row-wise or table-row-wise (checked when sharding).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

from recshard.comm import get_gradient_division
from recshard.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.modules.embedding_tables import embedding_names
from recshard.modules.feature_processor_ import (
    FeatureProcessorsCollection,
    bag_positions,
    gather_position_weights,
    position_length_error,
    with_weights,
)
from recshard.modules.fp_embedding_modules import (
    FeatureProcessedEmbeddingBagCollection,
    apply_feature_processors_to_kjt,
    other_processors_of,
    position_weights_of,
)
from recshard.modules.materialize import materialize
from recshard.sparse import KeyedJaggedTensor, KeyedTensor
from recshard.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ModuleSharder,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)

_SPLIT_BAGS = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _add_zero(kt: KeyedTensor, zero: torch.Tensor) -> KeyedTensor:
    return KeyedTensor(kt.keys(), kt.length_per_key(), kt.values() + zero, kt.key_dim())


class ShardedFeatureProcessedEmbeddingBagCollection(ShardedModule):
    """Sharded twin of `FeatureProcessedEmbeddingBagCollection`: a `ShardedEmbeddingBagCollection`
    (built by the EBC sharder) and the unsharded module's processors."""

    def __init__(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        embedding_bag_collection: ShardedEmbeddingBagCollection,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.env = env
        self._device = torch.device(device or "cpu")
        self._embedding_bag_collection = embedding_bag_collection
        self._feature_processors = module._feature_processors
        materialize(self._feature_processors, self._device)
        self._feature_processors.to(self._device)
        configs = embedding_bag_collection.embedding_bag_configs()
        self._feature_of = dict(
            zip(embedding_names(configs), [f for c in configs for f in c.feature_names])
        )
        self._check_processors(module, embedding_bag_collection)

    def _check_processors(
        self, module: FeatureProcessedEmbeddingBagCollection, ebc: ShardedEmbeddingBagCollection
    ) -> None:
        """Processors that see whole bags need tables whose bags stay on one rank."""
        if other_processors_of(self._feature_processors) is None:
            return
        owner = type(module).__name__
        split = [
            c.name
            for c in ebc.embedding_bag_configs()
            if ebc.table_plan(c.name).sharding_type in _SPLIT_BAGS
        ]
        if split:
            raise ValueError(
                f"{owner}: tables {split} are sharded row-wise, which splits bags across ranks; "
                "only position-weight processors work on them (other processors see whole bags)"
            )
        if isinstance(self._feature_processors, FeatureProcessorsCollection) and any(
            k != f for k, f in self._feature_of.items()
        ):
            raise ValueError(
                f"{owner}: a feature read by several tables needs per-feature processors or "
                "PositionWeightedModuleCollection, not a custom FeatureProcessorsCollection"
            )

    # ---------------------------------------------------------------- forward steps

    def create_context(self) -> EmbeddingModuleContext:
        return self._embedding_bag_collection.create_context()

    def input_dist(
        self, ctx: EmbeddingModuleContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[List[KeyedJaggedTensor]]]:
        """Check bag lengths (a rejection reaches every rank), carry positions as weights."""
        max_lengths = {f: int(p.numel()) for f, p in self._position_weights().items()}
        rejected = None
        try:
            rejected = position_length_error(features, max_lengths, type(self).__name__)
            positions = bag_positions(features.offsets(), features.values().numel())
            features = with_weights(features, positions.to(torch.float32))
        except (RuntimeError, ValueError, IndexError):
            pass  # a malformed batch: the EBC's own checks reject it, on every rank
        return self._embedding_bag_collection.input_dist(ctx, features, rejected)

    def compute(
        self, ctx: EmbeddingModuleContext, dist_input: List[KeyedJaggedTensor]
    ) -> List[torch.Tensor]:
        processed = [
            self._processed(kjt, kind)
            for kind, kjt in zip(self._embedding_bag_collection.shardings, dist_input)
        ]
        return self._embedding_bag_collection.compute(ctx, processed)

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        pooled = self._embedding_bag_collection.output_dist(ctx, output)
        params = list(self._feature_processors.parameters())
        if params:
            zero = torch.zeros((), device=self._device) * sum(p.sum() for p in params)
            pooled.callbacks.append(lambda kt: _add_zero(kt, zero))
        return pooled

    def _position_weights(self) -> Dict[str, nn.Parameter]:
        return position_weights_of(self._feature_processors)

    def _processed(self, features: KeyedJaggedTensor, kind: str) -> KeyedJaggedTensor:
        """The routed ids of one sharding, weighted by the processors (`features` carries each
        id's position as its weight)."""
        others = other_processors_of(self._feature_processors)
        if others is None:
            weights = gather_position_weights(
                features, features.weights().long(), self._position_weights(), self._feature_of
            )
        elif isinstance(others, FeatureProcessorsCollection):
            weights = self._feature_processors(with_weights(features, None)).weights()
        else:
            weights = apply_feature_processors_to_kjt(
                with_weights(features, None), dict(self._feature_processors), self._feature_of
            ).weights()
        world_size = self.env.world_size
        if kind != ShardingType.DATA_PARALLEL.value and world_size > 1 and get_gradient_division():
            weights = _ScaleGrad.apply(weights, float(world_size))
        return with_weights(features, weights)

    # ---------------------------------------------------------------- parameters and state

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """The tables' tensors only: the processors' parameters are DDP's."""
        yield from self._embedding_bag_collection.sharded_parameter_names(
            _join(prefix, "_embedding_bag_collection")
        )

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """The unsharded module's names: `_embedding_bag_collection.embedding_bags.<t>.weight`
        (this rank's shards) and the processors' parameters."""
        if not recurse:
            return
        yield from self._embedding_bag_collection.named_parameters(
            _join(prefix, "_embedding_bag_collection"), recurse, remove_duplicate
        )
        yield from self._feature_processors.named_parameters(
            _join(prefix, "_feature_processors"), recurse, remove_duplicate
        )

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        if not recurse:
            return
        yield from self._feature_processors.named_buffers(
            _join(prefix, "_feature_processors"), recurse, remove_duplicate
        )

    def embedding_bag_configs(self) -> List[Any]:
        return self._embedding_bag_collection.embedding_bag_configs()

    def is_weighted(self) -> bool:
        return True


class FeatureProcessedEmbeddingBagCollectionSharder(ModuleSharder[nn.Module]):
    """Shards the EBC inside a `FeatureProcessedEmbeddingBagCollection` with `ebc_sharder`
    (default: `EmbeddingBagCollectionSharder()`): every sharding type and kernel it offers."""

    def __init__(
        self,
        ebc_sharder: EmbeddingBagCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self._ebc_sharder = ebc_sharder or EmbeddingBagCollectionSharder(
            qcomm_codecs_registry=qcomm_codecs_registry
        )

    @property
    def module_type(self) -> type:
        return FeatureProcessedEmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type:
        return ShardedFeatureProcessedEmbeddingBagCollection

    @property
    def fused_params(self) -> Dict[str, Any] | None:
        return self._ebc_sharder.fused_params

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return self._ebc_sharder.sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return self._ebc_sharder.compute_kernels(sharding_type, compute_device_type)

    def shardable_parameters(
        self, module: FeatureProcessedEmbeddingBagCollection
    ) -> Dict[str, nn.Parameter]:
        return self._ebc_sharder.shardable_parameters(module._embedding_bag_collection)

    def shard(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedFeatureProcessedEmbeddingBagCollection:
        ebc = self._ebc_sharder.shard(module._embedding_bag_collection, params, env, device)
        return ShardedFeatureProcessedEmbeddingBagCollection(module, ebc, env, device)
