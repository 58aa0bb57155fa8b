"""Cross-entropy over logits split by class across `pg`, without gathering the logits.

log p_c = z_c - m - log(sum_k exp(z_k - m)), with m the max over all ranks (an all-reduce of
the max), then one all-reduce (sum) that carries, per row, the local sum of exps, the target
logit (found on exactly one rank) and, with label smoothing, the local sum of (weighted)
logits. Semantics follow `F.cross_entropy` with class-index targets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recshard.comm.pg import HoldsGroup
from recshard.parallel.mappings import all_reduce, mp_reduce
from recshard.parallel.utils import ProcessGroup, group_rank, group_size

_REDUCTIONS = ("mean", "sum", "none")
_OWNER = "vocab_parallel_cross_entropy"


def _check_inputs(
    logits: Tensor,
    target: Tensor,
    weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    num_classes: int,
) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{_OWNER}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{_OWNER}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(
            f"{_OWNER}: logits must be a float tensor [*, C / ws], got {logits.dtype}"
            f" {tuple(logits.shape)}"
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{_OWNER}: target shape {tuple(target.shape)} must equal the logits shape without "
            f"the class dim, {tuple(logits.shape[:-1])}"
        )
    if target.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{_OWNER}: target must hold class indices (int64), got {target.dtype}")
    if weight is not None and tuple(weight.shape) != (num_classes,):
        raise ValueError(
            f"{_OWNER}: weight must have shape ({num_classes},) (all classes, not a shard), "
            f"got {tuple(weight.shape)}"
        )
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        raise ValueError(
            f"{_OWNER}: target {int(target[bad][0])} is out of range [0, {num_classes}) "
            f"(and is not ignore_index={ignore_index})"
        )


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    pg: ProcessGroup | None = None,
) -> Tensor:
    """Cross-entropy of class-sharded logits.

    logits [*, C / ws]: this rank's classes [rank C/ws, (rank+1) C/ws); target [*] class
    indices (same on every rank); weight [C] per-class weights (full, replicated).
    Returns a scalar (mean/sum) or [*] (none), replicated, equal to
    `F.cross_entropy(all_gathered_logits, target, ...)`.
    """
    ws, rank = group_size(pg), group_rank(pg)
    local_classes = logits.shape[-1] if logits.dim() else 0
    num_classes = local_classes * ws
    _check_inputs(logits, target, weight, ignore_index, reduction, label_smoothing, num_classes)

    if ws == 1:  # one rank holds every class: PyTorch's fused kernel is the same math
        loss = F.cross_entropy(
            logits.reshape(-1, local_classes),
            target.reshape(-1).long(),
            weight,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
        )
        return loss.view(target.shape) if reduction == "none" else loss

    out_dtype = logits.dtype
    z = logits.reshape(-1, local_classes)
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    flat_target = target.reshape(-1).long()

    with torch.no_grad():
        row_max = z.amax(dim=-1)
        row_max = all_reduce(row_max, pg, "max") if ws > 1 else row_max
    shifted = z - row_max.unsqueeze(1)  # [N, C/ws], <= 0 on the rank holding the max

    ignored = flat_target == ignore_index
    local_target = flat_target - rank * local_classes
    owned = (local_target >= 0) & (local_target < local_classes) & ~ignored
    picked = shifted.gather(1, torch.where(owned, local_target, 0).unsqueeze(1)).squeeze(1)
    parts = [shifted.exp().sum(-1), torch.where(owned, picked, torch.zeros_like(picked))]
    local_weight = None
    if label_smoothing > 0:
        if weight is not None:
            start = rank * local_classes
            local_weight = weight[start : start + local_classes].to(shifted.dtype)
            parts.append((shifted * local_weight).sum(-1))
        else:
            parts.append(shifted.sum(-1))
    sums = mp_reduce(torch.stack(parts), pg)  # one all-reduce: [2 or 3, N]
    log_sum_exp = sums[0].log()
    nll = log_sum_exp - sums[1]  # -log p_target, per row

    safe_target = torch.where(ignored, 0, flat_target)
    if weight is None:
        row_weight = (~ignored).to(nll.dtype)
    else:
        row_weight = torch.where(ignored, 0, weight.to(nll.dtype)[safe_target])
    loss = nll * row_weight
    if label_smoothing > 0:
        total_weight = num_classes if weight is None else weight.to(nll.dtype).sum()
        smooth = total_weight * log_sum_exp - sums[2]  # -sum_c w_c log p_c
        smooth = torch.where(ignored, torch.zeros_like(smooth), smooth)
        loss = (1.0 - label_smoothing) * loss + (label_smoothing / num_classes) * smooth

    if reduction == "none":
        return loss.view(target.shape).to(out_dtype)
    if reduction == "sum":
        return loss.sum().to(out_dtype)
    return (loss.sum() / row_weight.sum()).to(out_dtype)


class ParallelCrossEntropyLoss(HoldsGroup, nn.Module):
    """`nn.CrossEntropyLoss` for class-sharded logits: (logits [*, C/ws], target [*]) -> loss.

    `weight` is the full per-class weight [C]; see `vocab_parallel_cross_entropy`.
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        pg: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"ParallelCrossEntropyLoss: reduction must be one of {_REDUCTIONS}, "
                f"got {reduction!r}"
            )
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.pg = label_smoothing, pg

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(
            logits,
            target,
            self.weight,
            self.ignore_index,
            self.reduction,
            self.label_smoothing,
            self.pg,
        )
