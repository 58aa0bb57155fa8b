"""The base class of sharded collections (EBC, EC and their quantized twins): the plan, the
forward path they share (`input_dist -> compute`; each subclass's `output_dist` takes the
looked-up rows to its output type), and how their local tables are stored.

Beside it, each in its own module: the tables as the shardings are built from them, with their
fused params parsed once (`table_specs.py`); the tables as state for state dicts and
checkpoints (`table_state.py`); the unsharded parameter names and the fused optimizer
(`unsharded_names.py`). The methods here that answer for those are one-line delegations.

Table storage is a value the class picks (`ShardedEmbeddingModule.storage_type`): float
tables (`FloatTables`: fused or dense kernels, trained) or quantized ones
(`recshard.distributed.quant_shards.QuantTables`, inference). Everything else, routing and
output dists included, is the same for both.

Float table state: if the unsharded module already has real weights (not `meta`), the shards
start from them — TorchRec re-initializes CPU modules silently; recshard keeps what the user
built.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Dict, Iterator, List, Tuple, Type

import torch
from torch import nn

from recshard.comm.pg import destroy_groups_at_exit
from recshard.distributed import table_state
from recshard.distributed.embedding_types import BaseEmbeddingSharder
from recshard.distributed.input_dist import CollectionInputDist, EmbeddingModuleContext
from recshard.distributed.key_value_step import fill_caches_agreed, prefetch_rows
from recshard.distributed.sharded_state import (
    load_model_state_dict,
    model_state_dict,
    quiet_sharded_tensor,
)
from recshard.distributed.table_specs import table_specs as build_table_specs
from recshard.distributed.table_state import Shards
from recshard.distributed.unsharded_names import fused_optimizer, unsharded_parameters
from recshard.lookup.fused_params import FusedOptimSpec, FusedParams, bounds_check_mode
from recshard.lookup.grouped import GroupedLookup
from recshard.lookup.key_value import CacheOverflowError
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import BaseEmbeddingConfig
from recshard.modules.embedding_tables import embedding_names
from recshard.optim.fused import FusedOptimizer
from recshard.plan.sharding_types import (
    ALL_SHARDING_TYPES,
    SEQUENCE_SHARDING_TYPES,
    supported_compute_kernels,
)
from recshard.plan.validate import check_module_plan
from recshard.sharding.common import EmbeddingSharding, Lookup, TableSpec
from recshard.sparse import KeyedJaggedTensor
from recshard.types import (
    Awaitable,
    BoundsCheckMode,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
)


class TableStorage(abc.ABC):
    """How a sharded collection's local tables hold their rows: which kernels its plan may
    name, the specs and the lookup each sharding is built with, and where the shards' first
    rows come from. One per sharded module, made from the unsharded one."""

    compute_kernels: ClassVar[List[str] | None] = None  # None: every kernel the type runs

    @abc.abstractmethod
    def __init__(self, module: nn.Module) -> None:
        """Keep what the storage needs of the unsharded `module` beyond `load`."""

    @abc.abstractmethod
    def check_plan(
        self, configs: List[BaseEmbeddingConfig], table_plans: EmbeddingModuleShardingPlan
    ) -> None:
        """Rules of this storage on top of `check_module_plan`'s."""

    @abc.abstractmethod
    def table_specs(self, sharded: ShardedEmbeddingModule, module: nn.Module) -> List[TableSpec]:
        """The tables the shardings are built from."""

    @abc.abstractmethod
    def make_lookup(
        self, tables: List[LocalTable], pooled: bool, device: torch.device, is_weighted: bool
    ) -> Lookup:
        """A sharding's lookup over this rank's shards (a `LookupFactory`)."""

    @abc.abstractmethod
    def load(self, sharded: ShardedEmbeddingModule, module: nn.Module) -> None:
        """Fill the built shards from the unsharded module."""


class FloatTables(TableStorage):
    """Trainable float tables: fused (fbgemm or torch) and dense kernels (`GroupedLookup`),
    with the fused params of `ShardedEmbeddingModule.table_specs`, starting from the unsharded
    weights and their attached optimizers (`init_from`)."""

    def __init__(self, module: nn.Module) -> None:
        """Nothing of `module` to keep: its weights are read once, by `load`."""

    def check_plan(
        self, configs: List[BaseEmbeddingConfig], table_plans: EmbeddingModuleShardingPlan
    ) -> None:
        """None beyond `check_module_plan`'s."""

    def table_specs(self, sharded: ShardedEmbeddingModule, module: nn.Module) -> List[TableSpec]:
        return sharded.table_specs(module)

    def make_lookup(
        self, tables: List[LocalTable], pooled: bool, device: torch.device, is_weighted: bool
    ) -> Lookup:
        return GroupedLookup(tables, pooled, device, is_weighted)

    def load(self, sharded: ShardedEmbeddingModule, module: nn.Module) -> None:
        sharded.init_from(module)


class ShardedEmbeddingModule(ShardedModule):
    """A sharded collection's plan, input side and tables; subclasses write the output step.

    Contract: a subclass's `__init__` calls `super().__init__(module, ...)` (makes
    `self.storage` from `storage_type`, checks the plan, keeps the metadata), builds its
    shardings from `self.storage.table_specs(self, module)` with `self.storage.make_lookup`,
    hands them to `set_shardings` (registers them, makes `self.input`, a
    `CollectionInputDist`), and calls `self.storage.load(self, module)`. `input_dist` and
    `compute` are defined here (the same for every collection); the subclass defines
    `output_dist` over `self.shardings`, which takes the looked-up rows to its output type.
    The `ShardedTableState` protocol (`sharded_state.py`, for state dicts and checkpoints)
    and the unsharded parameter names are answered here, from `table_state.py` and
    `unsharded_names.py`.
    """

    # How the local tables are stored: `FloatTables`, or the quantized twins' `QuantTables`.
    storage_type: ClassVar[Type[TableStorage]] = FloatTables
    _has_key_value = False  # set by the float tables' specs: any key_value table in the plan
    # A pooled module that takes a variable batch per feature (TorchRec's VBE); others refuse it.
    takes_variable_batch: ClassVar[bool] = False

    def __init__(
        self,
        module: nn.Module,
        tables_attr: str,
        configs: List[BaseEmbeddingConfig],
        table_plans: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None,
        fused_params: Dict[str, Any] | None,
        pooled: bool,
        is_weighted: bool,
    ) -> None:
        """Check the plan (errors name the unsharded module's class, batch errors this one's),
        keep the metadata. `tables_attr` holds the tables in the unsharded module
        (`embedding_bags` or `embeddings`): the prefix of their state_dict keys."""
        super().__init__()
        what = type(module).__name__
        self.storage = self.storage_type(module)
        check_module_plan(
            configs,
            table_plans,
            what,
            env.world_size,
            env.local_world_size,
            ALL_SHARDING_TYPES if pooled else SEQUENCE_SHARDING_TYPES,
            self.storage.compute_kernels,
        )
        self.storage.check_plan(configs, table_plans)
        destroy_groups_at_exit()  # its collectives could otherwise abort the process at exit
        self.env = env
        self._owner = type(self).__name__
        self._tables_attr = tables_attr
        self._device = torch.device(device or "cpu")
        self._configs = configs
        self._table_plans = dict(table_plans)
        self._fused_params = dict(fused_params or {})  # TorchRec's dict: parsed by table_specs
        default_mode = bounds_check_mode(self._fused_params.get("bounds_check_mode"))
        self._bounds_check_default = default_mode or BoundsCheckMode.FATAL
        self._is_weighted = is_weighted
        self._pooled = pooled
        self._table_fused_params: Dict[str, FusedParams] = {}
        self._embedding_names = embedding_names(configs)  # output keys: (table, feature)s
        self._embedding_dims = [c.embedding_dim for c in configs for _ in c.feature_names]

    def table_specs(self, module: nn.Module) -> List[TableSpec]:
        """Each table with its fused params, parsed once and checked (`table_specs.py`)."""
        specs = build_table_specs(
            getattr(module, self._tables_attr),
            self._configs,
            self._table_plans,
            self._fused_params,
            self.env,
            self._device,
            self._is_weighted,
        )
        self._table_fused_params = {s.config.name: s.fused_params for s in specs}
        # the plan's, the same on every rank: steps then agree on the key-value caches' verdict
        self._has_key_value = any(s.kernel == EmbeddingComputeKernel.KEY_VALUE for s in specs)
        return specs

    def set_shardings(self, shardings: Dict[str, EmbeddingSharding]) -> None:
        """Register the shardings as submodules and set up the input side over them."""
        self.shardings = shardings
        for name, sharding in shardings.items():
            self.add_module(f"sharding_{name}", sharding)
        self.input = CollectionInputDist(
            self._owner,
            self.env,
            self._device,
            self._configs,
            self._table_plans,
            self._bounds_check_default,
            self._is_weighted,
            list(shardings.values()),
            one_batch=self._pooled and not self.takes_variable_batch,
            variable_batch=self._pooled and self.takes_variable_batch,
        )

    def input_dist(
        self, ctx: EmbeddingModuleContext, features: KeyedJaggedTensor, rejected: str | None = None
    ) -> Awaitable[Awaitable[List[KeyedJaggedTensor]]]:
        """The same for every collection: check the batch, then route each sharding's ids to
        the ranks holding its tables (`CollectionInputDist`). `rejected`: a wrapping module's
        reason to refuse the batch, raised on every rank like this module's own."""
        return self.input.dist(ctx, features, rejected)

    def compute(
        self, ctx: EmbeddingModuleContext, dist_input: List[KeyedJaggedTensor]
    ) -> List[torch.Tensor]:
        """Each sharding's local lookup on the ids routed to this rank: pooled `[B_global,
        local cols]`, or one row per id `[N_recv, D]`. Key-value caches are filled first,
        every rank learning whether any rank's rows did not fit (`key_value_step`)."""
        if self._has_key_value:
            fill_caches_agreed(self.env, self._device, self.shardings.values(), dist_input)
        return [s.compute(kjt) for s, kjt in zip(self.shardings.values(), dist_input)]

    def prefetch(self, dist_input: List[KeyedJaggedTensor]) -> None:
        """Bring the rows the routed ids read into the key-value tables' DRAM caches (batch
        i+1's, while batch i trains: `PrefetchTrainPipelineSparseDist`). Rows that do not fit
        beside batch i's are left for the step's `compute`, which decides on every rank."""
        try:
            prefetch_rows(self.shardings.values(), dist_input)
        except CacheOverflowError:
            pass

    def create_context(self) -> EmbeddingModuleContext:
        return EmbeddingModuleContext(
            sharding_contexts=[s.create_context() for s in self.shardings.values()]
        )

    # ---------------------------------------------------------------- table state
    # What `recshard.distributed.sharded_state` (state_dict, checkpoints) reads: the
    # `ShardedTableState` protocol there.

    def table_key(self, table: str) -> str:
        """`table`'s weight as the unsharded module names it: `embedding_bags.<table>.weight`."""
        return f"{self._tables_attr}.{table}.weight"

    def table_configs(self) -> List[Any]:
        return list(self._configs)

    def table_plan(self, table: str) -> ParameterSharding:
        return self._table_plans[table]

    def fused_optim_spec(self, table: str) -> FusedOptimSpec:
        """The optimizer the fused kernel applies to `table` in backward (the sharder's fused
        params, or the optimizer attached to the table by `apply_optimizer_in_backward`)."""
        return self._table_fused_params[table].optim

    def fused_optimizer_states(self) -> Dict[str, List[Tuple[LocalTable, Dict[str, torch.Tensor]]]]:
        """Per table name, this rank's shards and their fused optimizer state (views)."""
        return table_state.fused_optimizer_states(self.shardings.values())

    def local_table_shards(self) -> Shards:
        """Per table name, this rank's shards and their live weights (views)."""
        return table_state.local_table_shards(self.shardings.values())

    def local_scale_bias(self) -> Shards:
        """Per quantized integer table, this rank's shards and their row scale/bias
        (`fp16 [rows, 2]`, views); empty for float tables."""
        return table_state.local_scale_bias(self.shardings.values())

    def load_full_quantized(
        self, full: Dict[str, Tuple[torch.Tensor, torch.Tensor | None]]
    ) -> None:
        """Copy each rank's slice out of unsharded quantized tables `{table: (values,
        scale_bias)}` (as `QuantEmbeddingBagCollection.quantized_weights` lays them out)."""
        with torch.no_grad():
            for sharding in self.shardings.values():
                sharding.lookup.load_slices(full)

    def load_full_tables(self, full: Dict[str, torch.Tensor]) -> None:
        """Copy each rank's slice out of full (unsharded) table tensors."""
        table_state.load_full_tables(self.local_table_shards(), full)

    def init_from(self, module: nn.Module) -> None:
        tables = getattr(module, self._tables_attr)
        full = {name: m.weight for name, m in tables.items() if m.weight.device.type != "meta"}
        self.load_full_tables(full)
        for sharding in self.shardings.values():
            sharding.after_init()

    def shard_fqn(self, table: LocalTable, shards_on_rank: int) -> str:
        """`embedding_bags.<table>.weight`, plus `@col<offset>` when this rank holds several
        column shards of the table."""
        return table_state.shard_fqn(self.table_key(table.name), table, shards_on_rank)

    # ---------------------------------------------------------------- unsharded names

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """Each table's local weight under its unsharded name (`embedding_bags.<t>.weight`, as
        `shard_fqn` names it), never the kernels' storage. A table with no shard here gives an
        empty parameter (as TorchRec); fused tables are marked `_in_backward_optimizers`."""
        if not recurse:  # the tables are not direct parameters of this module
            return
        for name, param in self._unsharded_parameters().items():
            yield (f"{prefix}.{name}" if prefix else name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        """None: kernel buffers (offsets, caches, optimizer state) are internal; weights are
        parameters and optimizer state is `fused_optimizer`'s."""
        return iter(())

    def state_dict(
        self,
        *args: Any,
        destination: Dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> Dict[str, Any]:
        """The tables as ShardedTensors under their unsharded names (`embedding_bags.<t>.weight`,
        global shape, this rank's shards), as TorchRec's sharded modules give them, also inside
        a parent's `state_dict()`; never the kernels' buffers."""
        with quiet_sharded_tensor():
            state = model_state_dict(self, prefix)
        if destination is None:
            return state
        destination.update(state)
        return destination

    def load_state_dict(
        self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load `state_dict()`'s keys: full tables are sliced per shard, ShardedTensors must be
        in this module's layout (`recshard.checkpoint.load` reshards)."""
        return load_model_state_dict(self, state_dict, strict)

    def _unsharded_parameters(self) -> Dict[str, nn.Parameter]:
        cached = self.__dict__.get("_unsharded_params_cache")
        if cached is None:
            cached = unsharded_parameters(
                self.table_key,
                self._configs,
                self._table_plans,
                self.local_table_shards(),
                self._device,
                self.env.pg,
            )
            self.__dict__["_unsharded_params_cache"] = cached  # a plain attribute, not registered
        return cached

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The in-backward optimizer of this module's fused tables (keyed by table FQN)."""
        return fused_optimizer(
            self, list(self.shardings.values()), self._configs, self._table_plans
        )


class EmbeddingModuleSharder(BaseEmbeddingSharder[nn.Module]):
    """What the collections' sharders share: `shard` builds `sharded_type(module, plan, env,
    device, fused_params, qcomm_codecs_registry)`, and the compute kernels offered are those its
    table storage runs."""

    sharded_type: ClassVar[Type[ShardedEmbeddingModule]]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels = self.sharded_type.storage_type.compute_kernels
        if kernels is None:
            return supported_compute_kernels(sharding_type, compute_device_type)
        return list(kernels)

    def shard(
        self,
        module: nn.Module,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedEmbeddingModule:
        return self.sharded_type(
            module, params, env, device, self.fused_params, self.qcomm_codecs_registry
        )
