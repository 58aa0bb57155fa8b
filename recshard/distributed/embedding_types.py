"""TorchRec's `torchrec.distributed.embedding_types` names: recshard's types under that path,
plus `KJTList` (the per-sharding feature batches a sharded module's input dist yields),
`compute_kernel_to_embedding_location` (where fbgemm keeps a kernel's rows on CUDA) and the
bases a user's own sharder subclasses (`BaseEmbeddingSharder`, `BaseQuantEmbeddingSharder`)."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, TypeVar

import torch
from torch import nn

from recshard.comm.one_to_all import KJTList
from recshard.modules.embedding_configs import DataType, PoolingType
from recshard.plan.sharding_types import supported_compute_kernels
from recshard.types import (
    EmbeddingComputeKernel,
    ModuleSharder,
    ParameterStorage,
    ShardedModule,
    ShardingType,
    ShardMetadata,
)

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "BaseEmbeddingSharder",
    "BaseQuantEmbeddingSharder",
    "DataType",
    "EmbeddingComputeKernel",
    "KJTList",
    "ModuleSharder",
    "PoolingType",
    "ShardMetadata",
    "ShardedModule",
    "ShardingType",
    "compute_kernel_to_embedding_location",
]


def compute_kernel_to_embedding_location(compute_kernel: EmbeddingComputeKernel) -> Any:  # noqa: ANN401
    """fbgemm's `EmbeddingLocation` for a kernel on CUDA: DEVICE for dense, fused and quant,
    MANAGED for the UVM kernel, MANAGED_CACHING for the UVM-caching one."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    kernel = EmbeddingComputeKernel(compute_kernel)
    if kernel in (
        EmbeddingComputeKernel.DENSE,
        EmbeddingComputeKernel.FUSED,
        EmbeddingComputeKernel.QUANT,
    ):
        return EmbeddingLocation.DEVICE
    if kernel == EmbeddingComputeKernel.FUSED_UVM:
        return EmbeddingLocation.MANAGED
    if kernel == EmbeddingComputeKernel.FUSED_UVM_CACHING:
        return EmbeddingLocation.MANAGED_CACHING
    raise ValueError(f"compute kernel {kernel.value!r} has no fbgemm embedding location")


class BaseEmbeddingSharder(ModuleSharder[M]):
    """The base of embedding sharders (recshard's collection sharders derive from it): keeps
    `fused_params` and `qcomm_codecs_registry` and offers TorchRec's default sharding types
    (data-, table-, column- and table-column-wise; on CUDA row- and table-row-wise too) and
    the compute kernels recshard runs for each. A subclass gives `module_type`,
    `shardable_parameters` and `shard`."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = [
            ShardingType.DATA_PARALLEL,
            ShardingType.TABLE_WISE,
            ShardingType.COLUMN_WISE,
            ShardingType.TABLE_COLUMN_WISE,
        ]
        if compute_device_type == "cuda":
            types += [ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE]
        return [t.value for t in types]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return supported_compute_kernels(sharding_type, compute_device_type)

    def storage_usage(
        self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str
    ) -> Dict[str, int]:
        """Bytes of `tensor` by where they live: host memory (DDR) on CPU and for the UVM
        kernels, device memory (HBM) otherwise."""
        size = tensor.numel() * tensor.element_size()
        host = compute_device_type == "cpu" or compute_kernel in (
            EmbeddingComputeKernel.FUSED_UVM.value,
            EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
        )
        return {(ParameterStorage.DDR if host else ParameterStorage.HBM).value: size}


class BaseQuantEmbeddingSharder(ModuleSharder[M]):
    """TorchRec's base of quantized (inference) sharders: table-, row- and column-wise with
    the `quant` kernel; the shardable parameters are the module's `<...>.<table>.weight`
    state entries by table name, limited to `shardable_params` when given. A subclass gives
    `module_type` and `shard`."""

    def __init__(
        self,
        fused_params: Dict[str, Any] | None = None,
        shardable_params: List[str] | None = None,
    ) -> None:
        super().__init__(copy.deepcopy(fused_params))
        self._shardable_params = list(shardable_params or [])

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [
            t.value
            for t in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
        ]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.QUANT.value]

    def shardable_parameters(self, module: M) -> Dict[str, nn.Parameter]:
        tables = {
            name.split(".")[-2]: value
            for name, value in module.state_dict().items()
            if name.endswith(".weight")
        }
        unknown = [t for t in self._shardable_params if t not in tables]
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: shardable_params {unknown} are not tables of the "
                f"{type(module).__name__} (its tables: {sorted(tables)})"
            )
        if self._shardable_params:
            tables = {t: v for t, v in tables.items() if t in self._shardable_params}
        return tables
