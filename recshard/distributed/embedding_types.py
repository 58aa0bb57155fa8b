"""TorchRec's `torchrec.distributed.embedding_types` names: recshard's types under that path,
plus `KJTList` (the per-sharding feature batches a sharded module's input dist yields) and
`compute_kernel_to_embedding_location` (where fbgemm keeps a kernel's rows on CUDA)."""

from __future__ import annotations

from typing import Any

from recshard.comm.one_to_all import KJTList
from recshard.modules.embedding_configs import DataType, PoolingType
from recshard.types import (
    EmbeddingComputeKernel,
    ModuleSharder,
    ShardedModule,
    ShardingType,
    ShardMetadata,
)

__all__ = [
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
