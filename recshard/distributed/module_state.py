"""What sharded collections (EBC and EC) share: the input side and the table state.

Input side: check the batch (structure, features, dtypes, weights, each table's bounds-check
mode) before any collective; a rejected batch still joins the splits exchange carrying the
verdict, so every rank raises at the first wait instead of hanging. A module with no splits
exchange (every table data-parallel) exchanges the verdict on its own (`comm/verdict.py`).
The accepted batch is permuted once into the shardings' concatenated wire order and split
among them.

Table state: if the unsharded module already has real weights (not `meta`), the shards start
from them — TorchRec re-initializes CPU modules silently; recshard keeps what the user built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from recshard.comm.verdict import exchange_verdict
from recshard.distributed.sharded_state import fused_state
from recshard.lookup.fused_params import FusedOptimSpec, check_backend, parse_fused_params
from recshard.lookup.grouped import uses_fbgemm
from recshard.lookup.tables import LocalTable
from recshard.modules.input_checks import bounds_check, check_dtypes_and_weights, check_features
from recshard.optim.apply_optimizer_in_backward import apply_optimizer_in_backward, fused_params_for
from recshard.optim.fused import FusedOptimizer
from recshard.plan.sharding_types import ALL_SHARDING_TYPES, SEQUENCE_SHARDING_TYPES
from recshard.plan.validate import check_module_plan
from recshard.sharding.common import EmbeddingShardingContext, TableSpec
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse.validation import validate_kjt
from recshard.types import (
    Awaitable,
    BoundsCheckMode,
    EmbeddingComputeKernel,
    FnAwaitable,
    ParameterSharding,
)


@dataclass
class EmbeddingModuleContext:
    """One batch's state in a sharded collection, from `input_dist` to `output_dist`."""

    features: Optional[KeyedJaggedTensor] = None  # the checked batch, in the caller's key order
    sharding_contexts: List[EmbeddingShardingContext] = field(default_factory=list)  # by sharding

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        if self.features is not None:
            self.features.record_stream(stream)
        for context in self.sharding_contexts:
            context.record_stream(stream)


class _ListAwaitable(Awaitable[List[Any]]):
    """Waits a list of awaitables; the result of each wait may itself be an awaitable."""

    def __init__(self, awaitables: List[Awaitable[Any]]) -> None:
        super().__init__()
        self._awaitables = awaitables

    def _wait_impl(self) -> List[Any]:
        return [a.wait() for a in self._awaitables]


def _mode(value: Any) -> Optional[BoundsCheckMode]:
    if value is None or isinstance(value, BoundsCheckMode):
        return value
    return BoundsCheckMode(str(getattr(value, "name", value)).lower())


class ShardedTablesMixin:
    """Subclasses call `_init_collection(...)`, build their shardings from `_table_specs()`,
    then `_adopt_shardings(...)`."""

    _tables_attr = "embedding_bags"
    _owner = "ShardedEmbeddingBagCollection"

    # ---------------------------------------------------------------- construction

    def _init_collection(
        self,
        configs: List[Any],
        table_plans: Dict[str, Any],
        env: Any,
        device: Optional[torch.device],
        fused_params: Optional[Dict[str, Any]],
        pooled: bool,
        is_weighted: bool,
        what: str,
        compute_kernels: Optional[List[str]] = None,
    ) -> None:
        """Check the plan (`what` names the unsharded module in errors), keep the metadata."""
        features = [f for c in configs for f in c.feature_names]
        shared = sorted({f for f in features if features.count(f) > 1})
        if shared:
            raise ValueError(f"{what}: features {shared} are read by more than one table; "
                             "sharding a feature shared by several tables is not supported")
        check_module_plan(configs, table_plans, what, env.world_size, env.local_world_size,
                          ALL_SHARDING_TYPES if pooled else SEQUENCE_SHARDING_TYPES,
                          compute_kernels)
        self.env = env
        self._device = torch.device(device or "cpu")
        self._configs = configs
        self._table_plans = dict(table_plans)
        self._fused_params = dict(fused_params or {})
        self._is_weighted = is_weighted
        self._feature_names = [f for c in configs for f in c.feature_names]
        self._feature_dims = [c.embedding_dim for c in configs for _ in c.feature_names]

    def _table_specs(self, module: nn.Module) -> List[TableSpec]:
        """Each table with its fused params: the sharder's, overridden by the optimizer attached
        to the table's unsharded weight (`apply_optimizer_in_backward`). Checked here, on every
        rank, that the table's kernel runs that optimizer."""
        tables = getattr(module, self._tables_attr)
        specs = []
        for c in self._configs:
            fused = fused_params_for(tables[c.name].weight, self._fused_params, c.name)
            spec = TableSpec(c, self._table_plans[c.name], fused)
            if spec.kernel != EmbeddingComputeKernel.DENSE:
                fbgemm_on_cuda = self._device.type == "cuda" and uses_fbgemm(
                    spec.local_table(0), self._is_weighted)
                check_backend(parse_fused_params(fused, c.name), c.name, fbgemm_on_cuda)
            specs.append(spec)
        self._table_fused_params = {s.config.name: s.fused_params for s in specs}
        return specs

    def _adopt_shardings(self, shardings: Dict[str, Any]) -> None:
        """Register the shardings as submodules and set up the input side over them."""
        self._shardings = shardings
        for name, sharding in shardings.items():
            self.add_module(f"sharding_{name}", sharding)
        self._init_input_side()

    # ---------------------------------------------------------------- input side

    def _init_input_side(self) -> None:
        self._feature_to_table = {
            f: (c.name, c.num_embeddings) for c in self._configs for f in c.feature_names
        }
        default = _mode(self._fused_params.get("bounds_check_mode")) or BoundsCheckMode.FATAL
        self._bounds_modes = {
            c.name: _mode(self._table_plans[c.name].bounds_check_mode) or default for c in self._configs
        }
        self._warned: Set[Tuple[str, str]] = set()
        self._wire_features = [f for s in self._shardings.values() for f in s.input_features]
        self._wire_splits = [len(s.input_features) for s in self._shardings.values()]
        self._permute_cache: Dict[Tuple[str, ...], torch.Tensor] = {}

    def _checked(self, features: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, Optional[str]]:
        """(the batch to route, None) or (the batch, why it is rejected)."""
        try:
            validate_kjt(features)
            check_features(features, self._feature_names, self._owner)
            check_dtypes_and_weights(features, self._is_weighted, self._owner)
            features = bounds_check(features, self._feature_to_table, self._bounds_modes,
                                    self._owner, self._warned)
        except ValueError as e:
            return features, str(e)
        return features, None

    def _wire_permutation(self, keys: List[str]) -> torch.Tensor:
        cached = self._permute_cache.get(tuple(keys))
        if cached is None:
            index = {k: i for i, k in enumerate(keys)}
            cached = torch.tensor([index[f] for f in self._wire_features], dtype=torch.int32)
            self._permute_cache[tuple(keys)] = cached
        return cached

    def input_dist(
        self, ctx: EmbeddingModuleContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[List[KeyedJaggedTensor]]]:
        """Check the batch, permute it into wire order once, start every sharding's dist."""
        features, error = self._checked(features)
        ctx.features = features
        if error is None:
            if features.keys() != self._wire_features:  # already in wire order: no copy
                permutation = self._wire_permutation(features.keys())
                features = features.permute(permutation.tolist(), permutation.to(features.device))
            parts = features.split(self._wire_splits) if len(self._wire_splits) > 1 else [features]
        else:
            parts = [_placeholder(s.input_features) for s in self._shardings.values()]
        verdict = None  # no splits exchange carries the verdict: exchange it on its own
        if not any(s.carries_input_error for s in self._shardings.values()):
            verdict = exchange_verdict(self.env.pg, error, self._device)
            if verdict is None and error is not None:
                raise ValueError(error)
        splits = _ListAwaitable([
            s.input_dist(part, sharding_ctx, error)
            for s, sharding_ctx, part in zip(self._shardings.values(), ctx.sharding_contexts, parts)
        ])

        def start_tensors() -> Awaitable[List[KeyedJaggedTensor]]:
            if verdict is not None:
                verdict.wait()
            tensors = splits.wait()
            # every rank's batch size, learned in the splits exchange (unequal batches work)
            sizes = next((t.stride_per_rank for t in tensors if hasattr(t, "stride_per_rank")), None)
            if sizes is not None and len(set(sizes)) > 1:
                for sharding_ctx in ctx.sharding_contexts:
                    sharding_ctx.batch_size_per_rank = list(sizes)
            return _ListAwaitable(tensors)

        return FnAwaitable(start_tensors)

    def compute(
        self, ctx: EmbeddingModuleContext, dist_input: List[KeyedJaggedTensor]
    ) -> List[torch.Tensor]:
        return [s.compute(kjt) for s, kjt in zip(self._shardings.values(), dist_input)]

    def create_context(self) -> EmbeddingModuleContext:
        return EmbeddingModuleContext(
            sharding_contexts=[s.create_context() for s in self._shardings.values()])

    # ---------------------------------------------------------------- table state
    # What `recshard.distributed.sharded_state` (state_dict, checkpoints) reads: the
    # `ShardedTableState` protocol there.

    @property
    def tables_attr(self) -> str:
        """The attribute that holds the tables in the unsharded module (its state_dict keys)."""
        return self._tables_attr

    def table_configs(self) -> List[Any]:
        return list(self._configs)

    def table_plan(self, table: str) -> ParameterSharding:
        return self._table_plans[table]

    def fused_optim_spec(self, table: str) -> FusedOptimSpec:
        """The optimizer the fused kernel applies to `table` in backward (the sharder's fused
        params, or the optimizer attached to the table by `apply_optimizer_in_backward`)."""
        return parse_fused_params(self._table_fused_params[table], table)

    def fused_optimizer_states(self) -> Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]]:
        """Per table name, this rank's shards and their fused optimizer state (views)."""
        out: Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]] = {}
        for sharding in self._shardings.values():
            for kernel in sharding.lookup.kernels:
                if kernel.is_fused:
                    for table, states in zip(kernel.tables, kernel.optimizer_states()):
                        out.setdefault(table.name, []).append((table, states))
        return out

    def local_table_shards(self) -> Dict[str, List[Tuple[LocalTable, torch.Tensor]]]:
        """Per table name, this rank's shards and their live weights (views)."""
        out: Dict[str, List[Tuple[LocalTable, torch.Tensor]]] = {}
        for sharding in self._shardings.values():
            for table, weight in sharding.local_shards():
                out.setdefault(table.name, []).append((table, weight))
        return out

    def load_full_tables(self, full: Dict[str, torch.Tensor]) -> None:
        """Copy each rank's slice out of full (unsharded) table tensors."""
        with torch.no_grad():
            for name, shards in self.local_table_shards().items():
                if name not in full:
                    continue
                tensor = full[name]
                for table, weight in shards:
                    block = tensor[table.row_offset:table.row_offset + table.rows,
                                   table.col_offset:table.col_offset + table.cols]
                    if tuple(block.shape) != tuple(weight.shape):
                        raise ValueError(
                            f"table '{name}': shard needs a {tuple(weight.shape)} block, the source "
                            f"tensor of shape {tuple(tensor.shape)} gives {tuple(block.shape)}"
                        )
                    weight.copy_(block)

    def _init_from(self, module: nn.Module) -> None:
        tables = getattr(module, self._tables_attr)
        full = {name: m.weight for name, m in tables.items() if m.weight.device.type != "meta"}
        self.load_full_tables(full)
        for name, shards in self.local_table_shards().items():  # dense kernels: torch runs it
            classes = getattr(tables[name].weight, "_optimizer_classes", [])
            kwargs = getattr(tables[name].weight, "_optimizer_kwargs", [])
            for table, weight in shards:
                if table.compute_kernel == EmbeddingComputeKernel.DENSE:
                    for optimizer_class, optimizer_kwargs in zip(classes, kwargs):
                        apply_optimizer_in_backward(optimizer_class, [weight], optimizer_kwargs)
        for sharding in self._shardings.values():
            sharding.after_init()

    def shard_fqn(self, table: LocalTable, shards_on_rank: int) -> str:
        """`embedding_bags.<table>.weight`, plus `@col<offset>` when this rank holds several
        column shards of the table."""
        name = f"{self._tables_attr}.{table.name}.weight"
        return f"{name}@col{table.col_offset}" if shards_on_rank > 1 else name

    # ---------------------------------------------------------------- unsharded names

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """Each table's local weight under its unsharded name (`embedding_bags.<t>.weight`, as
        `shard_fqn` names it), never the kernels' storage. A table with no shard here gives an
        empty parameter (as TorchRec); fused tables are marked `_in_backward_optimizers`."""
        if not recurse:  # the tables are not direct parameters of this module
            return
        for name, param in self._unsharded_parameters().items():
            yield (f"{prefix}.{name}" if prefix else name), param

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """None: kernel buffers (offsets, caches, optimizer state) are internal; weights are
        parameters and optimizer state is `fused_optimizer`'s."""
        return iter(())

    def _unsharded_parameters(self) -> Dict[str, nn.Parameter]:
        cached = self.__dict__.get("_unsharded_params_cache")
        if cached is not None:
            return cached
        cached = {}
        shards = self.local_table_shards()
        for config in self._configs:
            local = shards.get(config.name, [])
            fused = self._table_plans[config.name].compute_kernel != EmbeddingComputeKernel.DENSE.value
            if not local:
                local_param = nn.Parameter(torch.empty(0, device=self._device), requires_grad=False)
                local_param._in_backward_optimizers = fused
                cached[f"{self._tables_attr}.{config.name}.weight"] = local_param
            for table, weight in local:
                if not isinstance(weight, nn.Parameter):  # fused storage: an alias, no grad
                    weight = nn.Parameter(weight.detach(), requires_grad=False)
                    weight._in_backward_optimizers = True
                cached[self.shard_fqn(table, len(local))] = weight
        self.__dict__["_unsharded_params_cache"] = cached  # a plain attribute, not registered
        return cached

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The in-backward optimizer of this module's fused tables (keyed by table FQN)."""
        counts = {name: len(shards) for name, shards in self.local_table_shards().items()}
        kernels, names = [], []
        for sharding in self._shardings.values():
            for kernel in sharding.lookup.kernels:
                if kernel.is_fused:
                    kernels.append(kernel)
                    names.append([self.shard_fqn(t, counts[t.name]) for t in kernel.tables])
        return FusedOptimizer(kernels, names, self._sharded_optimizer_state)

    def _sharded_optimizer_state(self) -> Dict[str, Dict[str, Any]]:
        """`{table fqn: {state name: ShardedTensor}}`: the fused state laid out like its table
        (views of the live state), for the fused optimizer's `state_dict()`."""
        nested: Dict[str, Dict[str, Any]] = {  # every fused table, on every rank (SGD: {})
            f"{self._tables_attr}.{c.name}.weight": {} for c in self._configs
            if self._table_plans[c.name].compute_kernel != EmbeddingComputeKernel.DENSE.value}
        for key, value in fused_state(self, "").items():
            fqn, name = key.split(".weight.", 1)
            nested.setdefault(f"{fqn}.weight", {})[name] = value
        return nested


def _placeholder(keys: List[str]) -> KeyedJaggedTensor:
    """An empty batch with the wire keys: lets a rejecting rank join the splits exchange."""
    return KeyedJaggedTensor(keys, torch.empty(0, dtype=torch.int64),
                             lengths=torch.zeros(0, dtype=torch.int32), stride=0, validate=False)
