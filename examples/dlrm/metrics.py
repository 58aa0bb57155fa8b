"""Eval metrics over all ranks, from torchmetrics: AUC, accuracy and normalized entropy.

Normalized entropy (He et al., 2014) = mean log loss / entropy of the average label: 1.0 is
no better than always predicting the base rate, lower is better.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn.functional as F
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC


class NormalizedEntropy(Metric):
    """NE from logits and 0/1 labels, summed over updates (and ranks when synced)."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, eps: float = 1e-12, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eps = eps
        self.add_state(
            "log_loss", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "positives", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        labels = labels.to(torch.float64)
        loss = F.binary_cross_entropy_with_logits(logits.to(torch.float64), labels, reduction="sum")
        self.log_loss += loss
        self.positives += labels.sum()
        self.count += labels.numel()

    def compute(self) -> Dict[str, torch.Tensor]:
        """`{"ne", "log_loss" (mean), "samples"}` over everything seen."""
        if self.count == 0:
            nan = torch.tensor(float("nan"))
            return {"ne": nan, "log_loss": nan, "samples": self.count}
        p = (self.positives / self.count).clamp(self.eps, 1 - self.eps)
        entropy = -(p * torch.log(p) + (1 - p) * torch.log(1 - p))
        log_loss = self.log_loss / self.count
        return {"ne": log_loss / entropy, "log_loss": log_loss, "samples": self.count}


class EvalMetrics:
    """AUC, accuracy (threshold 0.5 on the probability), NE and mean loss over every rank.

    `compute()` is collective: every rank must call it (torchmetrics syncs over `process_group`).
    """

    def __init__(self, device: torch.device, process_group: Any | None = None) -> None:
        kwargs = {"process_group": process_group, "sync_on_compute": True}
        self.metrics = MetricCollection(
            {
                "auc": BinaryAUROC(**kwargs),
                "accuracy": BinaryAccuracy(**kwargs),
            }
        ).to(device)
        self.ne = NormalizedEntropy(**kwargs).to(device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """`logits [B]`, `labels [B]` (0/1)."""
        labels = labels.long()
        self.metrics.update(torch.sigmoid(logits.float()), labels)
        self.ne.update(logits, labels)

    def compute(self) -> Dict[str, float]:
        values = {name: float(v) for name, v in self.metrics.compute().items()}
        ne = self.ne.compute()
        values.update(
            ne=float(ne["ne"]), log_loss=float(ne["log_loss"]), samples=int(ne["samples"])
        )
        return values

    def reset(self) -> None:
        self.metrics.reset()
        self.ne.reset()
