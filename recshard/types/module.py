"""The shape of a sharded module (`input_dist -> compute -> output_dist`), its sharder, and
what the train pipeline needs of a batch."""

from __future__ import annotations

import abc
from typing import Any, Dict, Generic, Iterator, List, Protocol, Type, TypeVar, runtime_checkable

import torch
from torch import nn

from recshard.types.awaitable import Awaitable, LazyAwaitable
from recshard.types.sharding import EmbeddingModuleShardingPlan, ShardingEnv

M = TypeVar("M", bound=nn.Module)


@runtime_checkable
class Pipelineable(Protocol):
    """A batch the train pipeline can move between devices and CUDA streams."""

    def to(self, device: torch.device, non_blocking: bool = False) -> Pipelineable: ...

    def record_stream(self, stream: torch.Stream) -> None: ...

    def pin_memory(self) -> Pipelineable: ...


class NullShardingContext:
    """The context of a sharded module that carries nothing from input_dist to output_dist."""

    def record_stream(self, stream: torch.Stream) -> None:
        """Nothing to keep alive on `stream`."""


class ShardedModule(nn.Module, abc.ABC):
    """A module whose forward is `input_dist -> compute -> output_dist`, each asynchronous.

    `forward(*inputs)` runs the three steps in order; the train pipeline calls them apart
    so that the input dist of the next batch overlaps this batch's compute.
    """

    def create_context(self) -> Any:
        return None

    @abc.abstractmethod
    def input_dist(self, ctx: Any, *inputs: Any) -> Awaitable[Awaitable[Any]]: ...

    @abc.abstractmethod
    def compute(self, ctx: Any, dist_input: Any) -> Any: ...

    @abc.abstractmethod
    def output_dist(self, ctx: Any, output: Any) -> LazyAwaitable[Any]: ...

    def compute_and_output_dist(self, ctx: Any, dist_input: Any) -> LazyAwaitable[Any]:
        return self.output_dist(ctx, self.compute(ctx, dist_input))

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Internal names (as `nn.Module` gives them) of the tensors this module keeps in step
        itself, which DDP must leave alone: by default all of its parameters and buffers."""
        for name, _ in nn.Module.named_parameters(self, prefix=prefix):
            yield name
        for name, _ in nn.Module.named_buffers(self, prefix=prefix):
            yield name

    def forward(self, *inputs: Any) -> LazyAwaitable[Any]:
        ctx = self.create_context()
        dist_input = self.input_dist(ctx, *inputs).wait().wait()
        return self.compute_and_output_dist(ctx, dist_input)


class ModuleSharder(abc.ABC, Generic[M]):
    """Turns an unsharded module plus its per-table plan into a sharded module."""

    def __init__(
        self,
        fused_params: Dict[str, Any] | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        self._fused_params = dict(fused_params) if fused_params else None
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @property
    @abc.abstractmethod
    def module_type(self) -> Type[M]: ...

    @property
    def fused_params(self) -> Dict[str, Any] | None:
        return self._fused_params

    @property
    def qcomm_codecs_registry(self) -> Dict[str, Any] | None:
        return self._qcomm_codecs_registry

    @abc.abstractmethod
    def sharding_types(self, compute_device_type: str) -> List[str]: ...

    @abc.abstractmethod
    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]: ...

    @abc.abstractmethod
    def shardable_parameters(self, module: M) -> Dict[str, nn.Parameter]: ...

    @abc.abstractmethod
    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> ShardedModule: ...
