"""DistributedModelParallel: shard a whole model's embedding collections, DDP the rest.

    model = DistributedModelParallel(DLRMTrain(dlrm_on_meta), device=torch.device("cpu"))
    opt = CombinedOptimizer([model.fused_optimizer, KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), torch_optimizer_factory)])

Steps: (1) a plan — the given one, else the planner's `collective_plan` (rank 0 plans,
everyone receives it) — checked to be the same, for the same model, on every rank; (2) every
module the plan names is replaced by its sharded version (the same module object at two
paths is sharded once); (3) parameters still on `meta` are
materialized with `reset_parameters()` on every rank and broadcast from rank 0 by DDP;
(4) the dense rest is wrapped in DDP, leaving out parameters of the sharded modules (fused
tables update in backward; replicated tables average their own gradients).
"""

from __future__ import annotations

import abc
import copy
import inspect
from typing import Any, Callable, Dict, Iterator, List, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from recshard.comm.pg import destroy_groups_at_exit, warn_if_default_timeout
from recshard.distributed.embedding import EmbeddingCollectionSharder
from recshard.distributed.embeddingbag import EmbeddingBagCollectionSharder
from recshard.distributed.fp_embeddingbag import (
    FeatureProcessedEmbeddingBagCollectionSharder,
    ShardedFeatureProcessedEmbeddingBagCollection,
)
from recshard.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from recshard.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recshard.distributed.plan_agreement import check_ranks_agree, describe
from recshard.distributed.quant_embedding import QuantEmbeddingCollectionSharder
from recshard.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from recshard.distributed.sharded_state import (
    load_model_state_dict,
    model_state_dict,
    quiet_sharded_tensor,
)
from recshard.modules.materialize import materialize
from recshard.optim.keyed import CombinedOptimizer
from recshard.planner import EmbeddingShardingPlanner, Topology
from recshard.planner.search.planner import register_default_sharders
from recshard.types import ModuleSharder, ShardedModule, ShardingEnv, ShardingPlan


def default_sharders() -> List[ModuleSharder]:
    """The sharders DistributedModelParallel uses when none are given."""
    return [
        EmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(),
        FeatureProcessedEmbeddingBagCollectionSharder(),
        QuantEmbeddingBagCollectionSharder(),
        QuantEmbeddingCollectionSharder(),
        ManagedCollisionEmbeddingBagCollectionSharder(),
        ManagedCollisionEmbeddingCollectionSharder(),
    ]


register_default_sharders(default_sharders)


class DataParallelWrapper(abc.ABC):
    """How DistributedModelParallel makes the dense (unsharded) part data-parallel: `wrap`
    replaces `dmp._dmp_wrapped_module` (TorchRec's interface; subclass it to wrap otherwise)."""

    @abc.abstractmethod
    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        """Make `dmp`'s wrapped module data-parallel over `env`."""


class DefaultDataParallelWrapper(DataParallelWrapper):
    """Wraps the sharded model in DDP (gloo on CPU, NCCL on GPU: the process group's backend)
    as TorchRec's wrapper does (gradients as views of DDP's buckets, no broadcast of buffers
    each forward), but with a dynamic graph by default: TorchRec's `static_graph=True` gave
    wrong position-weight gradients in a sharded FP-EBC (docs/porting.md).

    `allreduce_comm_precision` "fp16" / "bf16": the dense gradients are all-reduced in that
    dtype (torch's `fp16_compress_hook` / `bf16_compress_hook`, on DMP's process group);
    `params_to_ignore`: more parameter or buffer names (the model's own) that DDP leaves
    alone; `ddp_kwargs`: further DistributedDataParallel arguments (not the ones set here)."""

    def __init__(
        self,
        bucket_cap_mb: int = 25,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        allreduce_comm_precision: str | None = None,
        params_to_ignore: List[str] | None = None,
        ddp_kwargs: Dict[str, Any] | None = None,
    ) -> None:
        if allreduce_comm_precision not in _COMPRESS_HOOKS:
            raise ValueError(
                f"DefaultDataParallelWrapper: allreduce_comm_precision must be one of "
                f"{list(_COMPRESS_HOOKS)}, got {allreduce_comm_precision!r}"
            )
        self._kwargs = dict(
            bucket_cap_mb=bucket_cap_mb,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        taken = sorted(set(ddp_kwargs or {}) & _SET_BY_WRAPPER)
        if taken:
            raise ValueError(
                f"DefaultDataParallelWrapper: ddp_kwargs {taken} are set by the wrapper "
                "(bucket_cap_mb, static_graph and find_unused_parameters are its own arguments)"
            )
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._comm_hook = _COMPRESS_HOOKS[allreduce_comm_precision]
        self._params_to_ignore = list(params_to_ignore or [])

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        """The unsharded parts move to `device` (as TorchRec's wrapper moves them, also on one
        rank); parameters of sharded modules and tensor-parallel shards (`recshard.parallel`,
        marked `shard_spec`: each rank's gradient is already complete) stay out of DDP."""
        module = dmp._dmp_wrapped_module
        self._check_static_graph(module)
        self._check_params_to_ignore(module)
        move_unsharded(module, device)
        ignore = list(_sharded_parameter_names(module)) + self._params_to_ignore
        ignore += [
            name
            for name, p in nn.Module.named_parameters(module)
            if getattr(getattr(p, "shard_spec", None), "world_size", 1) > 1
        ]
        dense = [
            p
            for n, p in nn.Module.named_parameters(module)
            if n not in set(ignore) and p.requires_grad
        ]
        if env.world_size == 1 or not dense:
            return
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignore)
        dmp._dmp_wrapped_module = DistributedDataParallel(
            module,
            device_ids=None if device.type == "cpu" else [device],
            process_group=env.pg,
            gradient_as_bucket_view=True,
            **_NO_FORWARD_BUFFER_SYNC,
            **self._kwargs,
            **self._ddp_kwargs,
        )
        if self._comm_hook is not None:  # DMP's group (TorchRec's state None: the default one)
            dmp._dmp_wrapped_module.register_comm_hook(env.pg, self._comm_hook)

    def _check_params_to_ignore(self, module: nn.Module) -> None:
        """Every name in `params_to_ignore` is a parameter or buffer of the model (DDP would
        ignore a misspelt one silently, and average the parameter meant)."""
        known = {n for n, _ in nn.Module.named_parameters(module)}
        known |= {n for n, _ in nn.Module.named_buffers(module)}
        unknown = [n for n in self._params_to_ignore if n not in known]
        if unknown:
            raise ValueError(
                f"DefaultDataParallelWrapper: params_to_ignore names {unknown}, which are not "
                "parameters or buffers of the model"
            )

    def _check_static_graph(self, module: nn.Module) -> None:
        """A static graph gives a sharded FP-EBC's processor parameters wrong gradients
        (measured: world size times the unsharded ones, or zeros): refused on every rank."""
        if not self._kwargs["static_graph"]:
            return
        processed = [
            name
            for name, child in module.named_modules()
            if isinstance(child, ShardedFeatureProcessedEmbeddingBagCollection)
        ]
        if processed:
            raise ValueError(
                f"DefaultDataParallelWrapper(static_graph=True): DDP's static graph gives the "
                f"feature processors of {processed} wrong gradients; use static_graph=False "
                "(the default)"
            )


# No buffer broadcast before every forward (TorchRec's `broadcast_buffers=False`); torch
# versions that deprecate that name (with a warning on every wrap) take `forward_sync_buffers`,
# which still syncs the buffers once at construction.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)
_SET_BY_WRAPPER = {
    "module",
    "device_ids",
    "process_group",
    "gradient_as_bucket_view",
    "broadcast_buffers",
    "forward_sync_buffers",
    "bucket_cap_mb",
    "static_graph",
    "find_unused_parameters",
}


def _bf16_allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN202
    """torch's `bf16_compress_hook` under another name: DDP refuses that name unless NCCL
    runs it, though gloo all-reduces bf16 (TorchRec's wrapper fails on CPU here). No
    annotations: DDP compares them with its classes, and this module's are strings."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


_COMPRESS_HOOKS: Dict[str | None, Callable[..., Any] | None] = {
    None: None,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": _bf16_allreduce_hook,
}


def move_unsharded(module: nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers of `module`'s unsharded parts to `device`; sharded
    modules (and everything under them) keep theirs."""

    def visit(child: nn.Module) -> None:
        if isinstance(child, ShardedModule):
            return
        child._apply(lambda t: t.to(device), recurse=False)
        for grandchild in child.children():
            visit(grandchild)

    visit(module)


def _sharded_parameter_names(module: nn.Module) -> Iterator[str]:
    """Internal names (as DDP sees them) of the tensors sharded modules keep in step."""
    for name, child in module.named_modules():
        if isinstance(child, ShardedModule):
            yield from child.sharded_parameter_names(name)


def _unsharded_named(
    module: nn.Module, prefix: str, buffers: bool, remove_duplicate: bool
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Parameters (or persistent-or-not buffers) under the unsharded model's names: sharded
    modules speak for their own subtree (`embedding_bags.<t>.weight`), kernels stay hidden."""
    seen: Set[int] = set()
    sharded: List[str] = []
    for path, child in module.named_modules(remove_duplicate=remove_duplicate):
        if any(path == s or s == "" or path.startswith(s + ".") for s in sharded):
            continue
        head = ".".join(p for p in (prefix, path) if p)
        if isinstance(child, ShardedModule):
            sharded.append(path)
            items = (
                child.named_buffers(prefix=head) if buffers else child.named_parameters(prefix=head)
            )
        else:
            own = child._buffers if buffers else child._parameters
            items = ((f"{head}.{n}" if head else n, t) for n, t in own.items() if t is not None)
        for name, tensor in items:
            if remove_duplicate and id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield name, tensor


def get_unwrapped_module(module: nn.Module) -> nn.Module:
    """Strip DMP and DDP wrappers."""
    while isinstance(module, (DistributedModelParallel, DistributedDataParallel)):
        module = (
            module._dmp_wrapped_module
            if isinstance(module, DistributedModelParallel)
            else module.module
        )
    return module


def get_module(module: nn.Module) -> nn.Module:
    """Unwrap a DMP once, as TorchRec does: its wrapped module (DDP-wrapped when data
    parallelism is on); use `get_unwrapped_module` to strip DDP too."""
    return module._dmp_wrapped_module if isinstance(module, DistributedModelParallel) else module


class DistributedModelParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        env: ShardingEnv | None = None,
        device: torch.device | None = None,
        plan: ShardingPlan | None = None,
        sharders: List[ModuleSharder] | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: DataParallelWrapper | None = None,
    ) -> None:
        super().__init__()
        self._env = env or ShardingEnv.from_process_group(dist.group.WORLD)
        warn_if_default_timeout(self._env.pg)
        destroy_groups_at_exit()
        self.device = torch.device(device or "cpu")
        self._sharders = sharders or default_sharders()
        self._sharder_map = {s.module_type: s for s in self._sharders}
        if plan is None:
            plan = self._collective_plan(module)
        self._agree_on_plan(module, plan)
        self._plan = plan
        self._dmp_wrapped_module: nn.Module = self._shard(module)
        if init_parameters:
            self._init_parameters(self._dmp_wrapped_module)
        self._data_parallel_wrapper = data_parallel_wrapper or DefaultDataParallelWrapper()
        if init_data_parallel:
            self.init_data_parallel()

    # ---------------------------------------------------------------- construction

    def _collective_plan(self, module: nn.Module) -> ShardingPlan:
        topology = Topology(
            world_size=self._env.world_size,
            compute_device=self.device.type,
            local_world_size=self._env.local_world_size,
        )
        planner = EmbeddingShardingPlanner(topology=topology)
        if self._env.pg is None:  # a local env (`ShardingEnv.from_local`): no one to agree with
            return planner.plan(module, self._sharders)
        return planner.collective_plan(module, self._sharders, self._env.pg)

    def _agree_on_plan(self, module: nn.Module, plan: ShardingPlan) -> None:
        """The plan must fit the model, and every rank must have the same plan and model
        (`plan_agreement.py`): checked on every rank together, so every rank raises."""
        try:
            _check_plan_paths(module, plan, self._sharder_map)
            items, error = describe(module, plan, self._sharder_map), None
        except ValueError as e:
            items, error = {"plan error": str(e)}, str(e)
        check_ranks_agree(items, self._env.pg, self.device)
        if error is not None:
            raise ValueError(error)

    def _shard(self, module: nn.Module) -> nn.Module:
        done: Dict[int, nn.Module] = {}

        def visit(parent: nn.Module, path: str) -> nn.Module:
            sharder = self._sharder_map.get(type(parent))
            module_plan = self._plan.get_plan_for_module(path)
            if sharder is not None and module_plan is not None:
                if id(parent) not in done:
                    done[id(parent)] = sharder.shard(parent, module_plan, self._env, self.device)
                return done[id(parent)]
            for name, child in list(parent.named_children()):
                new_child = visit(child, f"{path}.{name}" if path else name)
                if new_child is not child:
                    setattr(parent, name, new_child)
            return parent

        return visit(module, "")

    def _init_parameters(self, module: nn.Module) -> None:
        """Materialize `meta` tensors of the unsharded parts (DDP then broadcasts rank 0's)."""
        materialize(module, self.device, skip=lambda m: isinstance(m, ShardedModule))

    def init_data_parallel(self) -> None:
        """Wrap the dense part in DDP (call later for lazily initialized modules)."""
        if not isinstance(self._dmp_wrapped_module, DistributedDataParallel):
            self._data_parallel_wrapper.wrap(self, self._env, self.device)

    # ---------------------------------------------------------------- user API

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dmp_wrapped_module(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The sharded model without DDP."""
        return get_unwrapped_module(self)

    @property
    def plan(self) -> ShardingPlan:
        return self._plan

    @property
    def env(self) -> ShardingEnv:
        return self._env

    @property
    def fused_optimizer(self) -> CombinedOptimizer:
        """Every sharded module's fused optimizer, keyed by FQN in the model."""
        parts = [
            (path, m.fused_optimizer)
            for path, m in self.module.named_modules()
            if isinstance(m, ShardedModule) and hasattr(m, "fused_optimizer")
        ]
        return CombinedOptimizer(parts)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """The model's parameters under their unsharded names (no DMP/DDP prefix, no kernel
        internals): `ebc.embedding_bags.t0.weight` on every rank, empty where a rank holds none."""
        if not recurse:
            return
        yield from _unsharded_named(self.module, prefix, False, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        """The unsharded parts' buffers; sharded modules' kernel buffers stay hidden."""
        if not recurse:
            return
        yield from _unsharded_named(self.module, prefix, True, remove_duplicate)

    def bare_named_parameters(
        self, prefix: str = "", recurse: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """Parameters that a dense optimizer should see (fused kernels' internals excluded)."""
        for name, param in self.named_parameters(prefix, recurse):
            if not getattr(param, "_in_backward_optimizers", False):
                yield name, param

    @property
    def sparse_grad_parameter_names(self) -> List[str]:
        """Parameters whose gradients are sparse tensors (none: dense kernels use dense grads)."""
        return [n for n, p in self.named_parameters() if p.grad is not None and p.grad.is_sparse]

    def state_dict(
        self, *args: Any, prefix: str = "", keep_vars: bool = False, **kwargs: Any
    ) -> Dict[str, Any]:
        """Unsharded keys; sharded tables as ShardedTensors (global shape, this rank's shards)."""
        with quiet_sharded_tensor():
            return model_state_dict(self.module, prefix)

    def load_state_dict(
        self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return load_model_state_dict(self.module, state_dict, strict)

    def copy(self, device: torch.device) -> DistributedModelParallel:
        """A deep copy whose unsharded parts live on `device` (shards stay where they are)."""
        other = copy.deepcopy(self)
        move_unsharded(other.module, device)
        other.device = torch.device(device)
        return other


def _check_plan_paths(
    module: nn.Module, plan: ShardingPlan, sharder_map: Dict[type, ModuleSharder]
) -> None:
    """Every module path in the plan must name a module some sharder can shard."""
    modules = dict(module.named_modules())
    for path in plan.plan:
        target = modules.get(path)
        if target is None:
            shardable = [p for p, m in modules.items() if type(m) in sharder_map]
            raise ValueError(
                f"the plan names module '{path}', which the model lacks "
                f"(shardable modules: {shardable})"
            )
        if type(target) not in sharder_map:
            raise ValueError(
                f"the plan names module '{path}' of type {type(target).__name__}, "
                "which no sharder handles"
            )
