"""The example's DLRM: `recshard.models.dlrm` (TorchRec's DLRM / DLRM_DCN / DLRMTrain) built
from the command line's sizes, plus the hook `--tp-over-arch` needs.

    dense [B, 13] ──DenseArch──▶ [B, D] ─┐
    KJT (F features) ──SparseArch──▶ [B, F, D] ─┴─▶ InteractionArch ──▶ OverArch ──▶ logit [B, 1]

`interaction="dot"` is the paper's DLRM; `"dcn"` is `DLRM_DCN` (low-rank DCN-v2 cross net).
Everything builds on `device="meta"`; `DistributedModelParallel` materializes it.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from examples.dlrm.mc import build_managed_collision
from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.datasets.utils import Batch
from recshard.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from recshard.modules.embedding_modules import DeviceLike
from recshard.modules.feature_processor_ import PositionWeightedModuleCollection
from recshard.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection


class ExampleDLRMTrain(DLRMTrain):
    """`DLRMTrain` whose loss may cover the global batch: with `global_batch` set (by
    `examples.dlrm.tp`), the over arch returns every rank's logits and the labels are
    gathered to match; the returned logits are this rank's rows again."""

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__(dlrm_module)
        self.global_batch: nn.Module | None = None

    def forward(
        self, batch: Batch
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self.global_batch is None:
            return super().forward(batch)
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, self.global_batch(batch.labels.float()))
        logits = self.global_batch.mine(logits)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def build_dlrm(
    tables: List[EmbeddingBagConfig],
    dense_in_features: int,
    dense_arch_layer_sizes: List[int],
    over_arch_layer_sizes: List[int],
    interaction: str = "dot",
    device: DeviceLike = None,
    dcn_num_layers: int = 3,
    dcn_low_rank_dim: int = 64,
    position_weighted: Dict[str, int] | None = None,
    managed_collision: Tuple[int, int] | None = None,
) -> ExampleDLRMTrain:
    """The training module with an EBC over `tables`, everything on `device` (use "meta" to
    let DistributedModelParallel materialize it). `position_weighted` ({feature: max bag
    length}): those features' ids are weighted by their position in the bag (a
    `FeatureProcessedEmbeddingBagCollection` in the EBC's place). `managed_collision`
    (eviction interval, buckets): raw ids remapped by MCH modules in front of the tables
    (`examples.dlrm.mc`)."""
    if managed_collision is not None and position_weighted:
        raise ValueError("managed collision and position-weighted features do not combine")
    ebc: nn.Module = (
        build_managed_collision(tables, *managed_collision, device=device)
        if managed_collision is not None
        else EmbeddingBagCollection(
            tables=tables, is_weighted=bool(position_weighted), device=device
        )
    )
    if position_weighted:
        features = {f for t in tables for f in t.feature_names}
        unknown = sorted(set(position_weighted) - features)
        if unknown:
            raise ValueError(f"position-weighted features {unknown} are not sparse features")
        ebc = FeatureProcessedEmbeddingBagCollection(
            ebc, PositionWeightedModuleCollection(position_weighted, device=device)
        )
    if interaction == "dot":
        dlrm = DLRM(
            ebc,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            dense_device=device,
        )
    elif interaction == "dcn":
        dlrm = DLRM_DCN(
            ebc,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            dcn_num_layers,
            dcn_low_rank_dim,
            dense_device=device,
        )
    else:
        raise ValueError(f"interaction must be 'dot' or 'dcn', got {interaction!r}")
    return ExampleDLRMTrain(dlrm)
