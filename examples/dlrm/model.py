"""DLRM (Naumov et al., 2019) on a recshard `EmbeddingBagCollection`.

    dense [B, 13] ──DenseArch──▶ [B, D] ─┐
    KJT (F features) ──SparseArch──▶ [B, F, D] ─┴─▶ InteractionArch ──▶ OverArch ──▶ logit [B, 1]

`interaction="dot"` takes pairwise dot products of the F + 1 vectors (the paper's DLRM);
`interaction="dcn"` runs a low-rank DCN-v2 cross network over their concatenation.
Every module builds on `device="meta"`; `DistributedModelParallel` materializes it (every
parametrized module here has `reset_parameters`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from examples.dlrm.data.batch import Batch
from recshard import EmbeddingBagCollection, KeyedJaggedTensor

DeviceLike = Union[str, torch.device, None]


def _mlp(in_features: int, layer_sizes: List[int], device: DeviceLike,
         last_activation: bool = True) -> nn.Sequential:
    """Linear + ReLU per entry of `layer_sizes`; the last ReLU is optional."""
    layers: List[nn.Module] = []
    for i, out_features in enumerate(layer_sizes):
        layers.append(nn.Linear(in_features, out_features, device=device))
        if last_activation or i < len(layer_sizes) - 1:
            layers.append(nn.ReLU())
        in_features = out_features
    return nn.Sequential(*layers)


class DenseArch(nn.Module):
    """MLP over the dense features: `[B, in_features]` -> `[B, layer_sizes[-1]]`."""

    def __init__(self, in_features: int, layer_sizes: List[int], device: DeviceLike = None) -> None:
        super().__init__()
        self.model = _mlp(in_features, layer_sizes, device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class SparseArch(nn.Module):
    """Pooled embeddings of every sparse feature: KJT -> `[B, F, D]` (all tables of dim D)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        configs = embedding_bag_collection.embedding_bag_configs()
        dims = {c.embedding_dim for c in configs}
        if len(dims) != 1:
            raise ValueError(f"DLRM needs one embedding_dim for every table, got {sorted(dims)}")
        self.embedding_dim = dims.pop()
        self.feature_names = [f for c in configs for f in c.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features)  # KeyedTensor [B, F * D]
        values = pooled.values()
        return values.reshape(values.size(0), len(self.feature_names), self.embedding_dim)


class InteractionArch(nn.Module):
    """Pairwise dot products: `[B, D]`, `[B, F, D]` -> `[B, D + F (F + 1) / 2]`.

    The dense vector is kept as is and followed by the upper triangle (no diagonal) of the
    `(F + 1) x (F + 1)` Gram matrix of the dense and sparse vectors.
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.num_sparse_features = num_sparse_features
        self._triu: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def output_dim(embedding_dim: int, num_sparse_features: int) -> int:
        return embedding_dim + num_sparse_features * (num_sparse_features + 1) // 2

    def _triu_indices(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        if device not in self._triu:
            n = self.num_sparse_features + 1
            rows, cols = torch.triu_indices(n, n, 1, device=device)
            self._triu[device] = (rows, cols)
        return self._triu[device]

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        combined = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, F + 1, D]
        gram = torch.bmm(combined, combined.transpose(1, 2))  # [B, F + 1, F + 1]
        rows, cols = self._triu_indices(gram.device)
        return torch.cat([dense, gram[:, rows, cols]], dim=1)


class LowRankCrossLayer(nn.Module):
    """One DCN-v2 cross layer with a low-rank weight: `x0 * (U (V x) + b) + x`, `[B, N]`."""

    def __init__(self, in_features: int, low_rank: int, device: DeviceLike = None) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.empty(low_rank, in_features, device=device))
        self.u = nn.Parameter(torch.empty(in_features, low_rank, device=device))
        self.bias = nn.Parameter(torch.empty(in_features, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.v.is_meta:
            return
        nn.init.xavier_normal_(self.v)
        nn.init.xavier_normal_(self.u)
        nn.init.zeros_(self.bias)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * F.linear(F.linear(x, self.v), self.u, self.bias) + x


class LowRankCrossNet(nn.Module):
    """DCN-v2 cross network: `x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l`, `[B, N]` -> `[B, N]`."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int,
                 device: DeviceLike = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            LowRankCrossLayer(in_features, low_rank, device) for _ in range(num_layers)
        )

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = layer(x0, x)
        return x


class InteractionDCNArch(nn.Module):
    """DCN-v2 interaction: `[B, D]`, `[B, F, D]` -> `[B, (F + 1) D]`."""

    def __init__(self, embedding_dim: int, num_sparse_features: int, num_layers: int = 3,
                 low_rank: int = 64, device: DeviceLike = None) -> None:
        super().__init__()
        self.crossnet = LowRankCrossNet(
            (num_sparse_features + 1) * embedding_dim, num_layers, low_rank, device
        )

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.crossnet(torch.cat([dense, sparse.flatten(1)], dim=1))


class OverArch(nn.Module):
    """MLP to the logit: `[B, in_features]` -> `[B, layer_sizes[-1]]` (no final ReLU)."""

    def __init__(self, in_features: int, layer_sizes: List[int], device: DeviceLike = None) -> None:
        super().__init__()
        if len(layer_sizes) < 1:
            raise ValueError("OverArch needs at least one layer")
        self.model = _mlp(in_features, layer_sizes, device, last_activation=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class DLRM(nn.Module):
    """The whole model: `(dense [B, 13], KJT)` -> logits `[B, 1]`.

    `dense_arch_layer_sizes[-1]` must equal the tables' `embedding_dim`, and
    `over_arch_layer_sizes[-1]` must be 1 (TorchRec's convention, e.g. "512,512,256,1").
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: List[int],
        over_arch_layer_sizes: List[int],
        interaction: str = "dot",
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 64,
        dense_device: DeviceLike = None,
    ) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(embedding_bag_collection)
        dim = self.sparse_arch.embedding_dim
        num_sparse = len(self.sparse_arch.feature_names)
        if not dense_arch_layer_sizes or dense_arch_layer_sizes[-1] != dim:
            raise ValueError(
                f"the dense arch must end with the embedding dim {dim}, got {dense_arch_layer_sizes}"
            )
        if not over_arch_layer_sizes or over_arch_layer_sizes[-1] != 1:
            raise ValueError(f"the over arch must end with 1 (one logit), got {over_arch_layer_sizes}")
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, dense_device)
        if interaction == "dot":
            self.inter_arch: nn.Module = InteractionArch(num_sparse)
            inter_dim = InteractionArch.output_dim(dim, num_sparse)
        elif interaction == "dcn":
            self.inter_arch = InteractionDCNArch(dim, num_sparse, dcn_num_layers,
                                                 dcn_low_rank_dim, dense_device)
            inter_dim = (num_sparse + 1) * dim
        else:
            raise ValueError(f"interaction must be 'dot' or 'dcn', got {interaction!r}")
        self.over_arch = OverArch(inter_dim, over_arch_layer_sizes, dense_device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        dense = self.dense_arch(dense_features)
        sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense, sparse))


class DLRMTrain(nn.Module):
    """Wraps DLRM for training: `forward(batch)` -> `(loss, (loss, logits, labels))`, detached
    outputs for metrics; logits and labels are `[B]`. The shape `TrainPipelineSparseDist` expects."""

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.global_batch: Optional[nn.Module] = None  # set by examples.dlrm.tp

    def forward(
        self, batch: Batch
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        if self.global_batch is None:
            loss = self.loss_fn(logits, batch.labels.float())
        else:  # tensor-parallel over arch: logits cover every rank's batch
            loss = self.loss_fn(logits, self.global_batch(batch.labels.float()))
            logits = self.global_batch.mine(logits)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def build_dlrm(
    tables: List,
    dense_in_features: int,
    dense_arch_layer_sizes: List[int],
    over_arch_layer_sizes: List[int],
    interaction: str = "dot",
    device: DeviceLike = None,
    dcn_num_layers: int = 3,
    dcn_low_rank_dim: int = 64,
) -> DLRMTrain:
    """DLRMTrain with an EBC over `tables` (EmbeddingBagConfigs), everything on `device`
    (use "meta" to let DistributedModelParallel materialize it)."""
    ebc = EmbeddingBagCollection(tables=tables, device=device)
    dlrm = DLRM(ebc, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes,
                interaction, dcn_num_layers, dcn_low_rank_dim, dense_device=device)
    return DLRMTrain(dlrm)

