"""DLRM (Naumov et al., 2019) and its DCN-v2 variant, with TorchRec's classes and arguments.

    dense [B, in] ──DenseArch──▶ [B, D] ───────┐
    KJT (F features) ──SparseArch──▶ [B, F, D] ─┴─▶ InteractionArch ──▶ OverArch ──▶ logits [B, 1]

`DLRM` interacts the F + 1 vectors by pairwise dot products; `DLRM_DCN` replaces that with a
low-rank DCN-v2 cross network over their concatenation. `DLRMTrain` adds the BCE loss in the
`(loss, (loss, logits, labels))` shape `TrainPipelineSparseDist` expects. State_dict keys match
TorchRec's (the arches are built from `recshard.modules.mlp` / `crossnet`), and every module
builds on `meta` for `DistributedModelParallel` to materialize.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch
from torch import nn

from recshard.datasets.utils import Batch
from recshard.models import interaction
from recshard.modules import EmbeddingBagCollection
from recshard.modules.crossnet import LowRankCrossNet
from recshard.modules.embedding_configs import DeviceLike
from recshard.modules.mlp import MLP
from recshard.sparse import KeyedJaggedTensor


def choose(n: int, k: int) -> int:
    """`n` choose `k` (0 outside `0 <= k <= n`)."""
    return math.comb(n, k) if 0 <= k <= n else 0


class SparseArch(nn.Module):
    """Pooled embeddings of every sparse feature: KJT -> `[B, F, D]`, features in config order."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError("SparseArch needs at least one embedding table")
        dims = sorted({c.embedding_dim for c in configs})
        if len(dims) != 1:
            raise ValueError(f"DLRM needs one embedding_dim for every table, got {dims}")
        self.embedding_bag_collection = embedding_bag_collection
        self.D: int = dims[0]
        self._sparse_feature_names: List[str] = [f for c in configs for f in c.feature_names]
        self.F: int = len(self._sparse_feature_names)

    @property
    def sparse_feature_names(self) -> List[str]:
        return self._sparse_feature_names

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features)  # KeyedTensor [B, F * D], config order
        return pooled.values().reshape(-1, self.F, self.D)


class DenseArch(nn.Module):
    """ReLU MLP over the dense features: `[B, in_features]` -> `[B, layer_sizes[-1]]`."""

    def __init__(self, in_features: int, layer_sizes: List[int], device: DeviceLike = None) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, bias=True, activation="relu", device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class InteractionArch(nn.Module):
    """Pairwise dot products: `[B, D]`, `[B, F, D]` -> `[B, D + F + F choose 2]`.

    The dense vector, then the upper triangle (no diagonal) of the `(F + 1) x (F + 1)` Gram
    matrix of the dense and sparse vectors (`recshard.models.interaction`: torch's bmm with the
    triangle read by `gather` at its flat positions `triu_positions`, or on CPU the same bytes
    from kernels that compute only the triangle).
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.register_buffer(
            "triu_indices", torch.empty(2, 0, dtype=torch.long, device="cpu"), persistent=False
        )
        self.register_buffer(
            "triu_positions", torch.empty(0, dtype=torch.long, device="cpu"), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)compute the triangle's indices, e.g. after materializing from `meta`."""
        n = self.F + 1
        device = self.triu_indices.device
        self.triu_indices = torch.triu_indices(n, n, offset=1, device="cpu").to(device)
        self.triu_positions = self.triu_indices[0] * n + self.triu_indices[1]

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        # a module attribute, so that fx traces the call as a leaf
        return interaction.pairwise_interaction(
            dense_features, sparse_features, self.triu_positions
        )


class InteractionDCNArch(nn.Module):
    """DCN-v2 interaction: `[B, D]`, `[B, F, D]` -> `crossnet([B, (F + 1) D])`."""

    def __init__(self, num_sparse_features: int, crossnet: nn.Module) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.crossnet = crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat([dense_features.unsqueeze(1), sparse_features], dim=1)
        return self.crossnet(combined.flatten(1))


class OverArch(nn.Module):
    """ReLU MLP then a final linear layer to the logits: `[B, in]` -> `[B, layer_sizes[-1]]`."""

    def __init__(self, in_features: int, layer_sizes: List[int], device: DeviceLike = None) -> None:
        super().__init__()
        if len(layer_sizes) <= 1:
            raise ValueError(f"OverArch must have multiple layers, got layer_sizes {layer_sizes}")
        self.model = nn.Sequential(
            MLP(in_features, layer_sizes[:-1], bias=True, activation="relu", device=device),
            nn.Linear(layer_sizes[-2], layer_sizes[-1], bias=True, device=device),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)

    def linears(self) -> List[nn.Linear]:
        """Every linear layer in order; a ReLU follows each but the last."""
        return [*self.model[0].linears(), self.model[1]]


class DLRM(nn.Module):
    """`(dense [B, in], KJT)` -> logits `[B, over_arch_layer_sizes[-1]]`.

    `dense_arch_layer_sizes[-1]` must equal the tables' (common) `embedding_dim`.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: List[int],
        over_arch_layer_sizes: List[int],
        dense_device: DeviceLike = None,
    ) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(embedding_bag_collection)
        dim = self.sparse_arch.D
        if not dense_arch_layer_sizes or dense_arch_layer_sizes[-1] != dim:
            raise ValueError(
                f"embedding_bag_collection dimension ({dim}) and final dense arch layer size "
                f"({dense_arch_layer_sizes[-1] if dense_arch_layer_sizes else None}) must match"
            )
        num_sparse = self.sparse_arch.F
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, dense_device)
        self.inter_arch: nn.Module = InteractionArch(num_sparse)
        over_in = dim + choose(num_sparse, 2) + num_sparse
        self.over_arch = OverArch(over_in, over_arch_layer_sizes, dense_device)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(embedded_dense, embedded_sparse))


class DLRM_DCN(DLRM):  # noqa: N801 (TorchRec's name)
    """DLRM whose interaction is a low-rank DCN-v2 cross network of `dcn_num_layers` layers
    of rank `dcn_low_rank_dim` over the `(F + 1) * D` concatenated vectors."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: List[int],
        over_arch_layer_sizes: List[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        dense_device: DeviceLike = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            dense_device,
        )
        width = (self.sparse_arch.F + 1) * self.sparse_arch.D
        crossnet = LowRankCrossNet(width, dcn_num_layers, dcn_low_rank_dim, device=dense_device)
        self.inter_arch = InteractionDCNArch(self.sparse_arch.F, crossnet)
        self.over_arch = OverArch(width, over_arch_layer_sizes, dense_device)


class DLRMTrain(nn.Module):
    """DLRM with its loss: `forward(batch)` -> `(loss, (loss, logits, labels))`, the last three
    detached for metrics; logits and labels are `[B]`."""

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn: nn.Module = nn.BCEWithLogitsLoss()

    def forward(
        self, batch: Batch
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())
