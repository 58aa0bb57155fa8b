"""Fused (in-backward) optimizer settings and their row updates.

Users name the optimizer with fbgemm's `EmbOptimType` in `fused_params` (TorchRec's
vocabulary), or attach a torch optimizer (`recshard.optim.apply_optimizer_in_backward`).
fbgemm's CPU kernel runs EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD;
recshard's pure-torch kernel runs the same three with the same formulas, so tables whose dim
fbgemm cannot take (not a multiple of 4) and machines without fbgemm train identically.
ADAM runs only in fbgemm's CUDA kernel; `check_backend` rejects it elsewhere.

Duplicate ids in one batch: their gradients are summed first, then the row is updated once,
as a dense optimizer would do with the summed gradient (fbgemm's "exact" optimizers).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from recshard.types import BoundsCheckMode


class OptimType(enum.Enum):
    """Names match fbgemm's `EmbOptimType` values so either can be passed."""

    EXACT_SGD = "exact_sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    ADAM = "adam"


_FBGEMM_CUDA_ONLY = {OptimType.ADAM}
ANY_KERNEL = [o for o in OptimType if o not in _FBGEMM_CUDA_ONLY]  # fbgemm CPU and torch run these


_ALIASES = {
    "sgd": OptimType.EXACT_SGD,
    "adagrad": OptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD,
    "row_wise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD,
}
SUPPORTED = ", ".join(o.name for o in OptimType)


@dataclass(frozen=True)
class FusedOptimSpec:
    """What the fused kernel applies in backward. `state_names` are per-table state tensors."""

    optim: OptimType
    learning_rate: float
    eps: float = 1e-8
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999

    @property
    def state_names(self) -> List[str]:
        return {
            OptimType.EXACT_SGD: [],
            OptimType.EXACT_ADAGRAD: ["momentum1"],
            OptimType.EXACT_ROWWISE_ADAGRAD: ["momentum1"],
            OptimType.ADAM: ["momentum1", "momentum2"],
        }[self.optim]

    @property
    def rowwise_state(self) -> bool:
        """True when each state tensor holds one value per row (`[rows]`), not per element."""
        return self.optim == OptimType.EXACT_ROWWISE_ADAGRAD

    def state_shape(self, rows: int, cols: int) -> List[int] | None:
        if self.optim in (OptimType.EXACT_ADAGRAD, OptimType.ADAM):
            return [rows, cols]
        if self.optim == OptimType.EXACT_ROWWISE_ADAGRAD:
            return [rows]
        return None


DEFAULT_LEARNING_RATE = 0.01


@dataclass(frozen=True)
class FusedParams:
    """One table's fused params, parsed once from TorchRec's `fused_params` dict (see
    `recshard.distributed.table_specs`): the optimizer its fused kernel applies and where a
    key-value table keeps its rows. Keys recshard does not read are not kept."""

    optim: FusedOptimSpec = FusedOptimSpec(OptimType.EXACT_SGD, DEFAULT_LEARNING_RATE)
    cache_load_factor: float | None = None  # key_value: the share of rows cached in DRAM
    ssd_storage_directory: str | None = None  # key_value: where the rows' files go

    @staticmethod
    def parse(fused_params: Dict[str, Any] | None, table: str) -> FusedParams:
        """`fused_params` as `table`'s; errors name the table and the value."""
        params = fused_params or {}
        _check_output_dtype(params.get("output_dtype"), table)
        directory = params.get("ssd_storage_directory")
        return FusedParams(
            optim=parse_fused_params(params, table),
            cache_load_factor=_number(params, "cache_load_factor", 0.0, table) or None,
            ssd_storage_directory=str(directory) if directory else None,
        )


_FP32_NAMES = ("FP32", "FLOAT32", "TORCH.FLOAT32")  # SparseType, DataType, torch, str


def _check_output_dtype(output_dtype: Any, table: str) -> None:
    """TorchRec's `output_dtype` fused param: only fp32, what every float lookup returns."""
    name = str(getattr(output_dtype, "name", output_dtype)).upper()
    if output_dtype is not None and name not in _FP32_NAMES:
        raise ValueError(
            f"table '{table}': fused param output_dtype={output_dtype!r} is not supported: "
            "lookups return fp32 rows (FP16 tables included)"
        )


def bounds_check_mode(value: Any) -> BoundsCheckMode | None:
    """A bounds check mode given as the enum, its name or its value (fbgemm's or recshard's)."""
    if value is None or isinstance(value, BoundsCheckMode):
        return value
    return BoundsCheckMode(str(getattr(value, "name", value)).lower())


def parse_fused_params(fused_params: Dict[str, Any] | None, table: str) -> FusedOptimSpec:
    """Read `optimizer`, `learning_rate`, `eps`, `weight_decay` from fused params."""
    params = dict(fused_params or {})
    raw = params.get("optimizer", OptimType.EXACT_SGD)
    name = getattr(raw, "value", raw)
    name = str(name).lower()
    optim = _ALIASES.get(name)
    if optim is None:
        try:
            optim = OptimType(name)
        except ValueError:
            raise ValueError(
                f"table '{table}': fused optimizer {raw!r} is not supported on this kernel; "
                f"supported: {SUPPORTED} (use compute_kernel='dense' with any torch optimizer "
                "for others)"
            ) from None
    if params.get("weight_decay", 0.0):
        raise ValueError(f"table '{table}': fused weight_decay is not supported yet")
    return FusedOptimSpec(
        optim=optim,
        learning_rate=_number(params, "learning_rate", DEFAULT_LEARNING_RATE, table),
        eps=_number(params, "eps", 1e-8, table),
        beta1=_number(params, "beta1", 0.9, table),
        beta2=_number(params, "beta2", 0.999, table),
    )


def _number(params: Dict[str, Any], key: str, default: float, table: str) -> float:
    """`params[key]` as a float; `default` when absent or None."""
    value = params.get(key)
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"table '{table}': fused param {key}={value!r} is not a number") from None


def check_backend(spec: FusedOptimSpec, table: str, fbgemm_on_cuda: bool) -> None:
    """Raise if the kernel that will run `table` cannot apply `spec` (never fall back)."""
    if spec.optim in _FBGEMM_CUDA_ONLY and not fbgemm_on_cuda:
        raise ValueError(
            f"table '{table}': fused optimizer {spec.optim.name} runs only in fbgemm's CUDA "
            f"kernel, not on this table's kernel (CPU, or a table fbgemm cannot take); "
            f"supported here: {', '.join(o.name for o in ANY_KERNEL)}"
        )


def fbgemm_optim_kwargs(spec: FusedOptimSpec) -> Dict[str, Any]:
    """Constructor arguments for fbgemm's TBE that implement `spec`."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kwargs = {
        "optimizer": EmbOptimType(spec.optim.value),
        "learning_rate": spec.learning_rate,
        "eps": spec.eps,
    }
    if spec.optim == OptimType.ADAM:
        kwargs.update(beta1=spec.beta1, beta2=spec.beta2)
    return kwargs


def apply_row_update(
    spec: FusedOptimSpec,
    lr: float,
    weight: torch.Tensor,
    state: Dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    state_rows: torch.Tensor | None = None,
) -> None:
    """Update `weight[rows]` in place from the summed fp32 gradient `grad` `[len(rows), D]`;
    the state stays fp32 whatever the weights' dtype (as fbgemm keeps it). `state_rows`: where
    the rows' state is when not at `rows` (a key-value table's cache holds the weights by slot
    and its row-wise state by table row)."""
    if spec.optim == OptimType.EXACT_SGD:
        _add_to_rows(weight, rows, grad * -lr, round_update=True)
        return
    at = rows if state_rows is None else state_rows
    momentum = state["momentum1"]
    if spec.optim == OptimType.EXACT_ADAGRAD:
        m = momentum.index_select(0, at) + grad * grad
        momentum.index_copy_(0, at, m)
        _add_to_rows(weight, rows, -lr * grad / (_sqrt(m) + spec.eps), round_update=True)
        return
    m = momentum.index_select(0, at) + (grad * grad).mean(dim=1)
    momentum.index_copy_(0, at, m)
    update = -(lr / (_sqrt(m) + spec.eps)).unsqueeze(1) * grad
    _add_to_rows(weight, rows, update, round_update=False)


def _sqrt(m: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of fp32 `m`, as C's `sqrtf` (fbgemm's and recshard's
    C++ kernels): torch's fp32 `sqrt` on CPU is not (torch 2.13, AVX512: sqrt(2.380859375)
    comes out 1 ulp high); in fp64, rounded once to fp32, it is."""
    return m.double().sqrt().to(m.dtype)


def _add_to_rows(
    weight: torch.Tensor, rows: torch.Tensor, update: torch.Tensor, round_update: bool
) -> None:
    """`weight[rows] += update` (fp32 `update`, unique `rows`). Narrower weights (fp16) round
    as fbgemm's CPU kernel does (bit for bit where the fp32 gradients agree): SGD and Adagrad
    round the update to the weight's dtype and add in it (`round_update`); row-wise Adagrad
    adds in fp32 and rounds the sum once."""
    if weight.dtype == update.dtype:
        weight.index_add_(0, rows, update)
    elif round_update:
        weight.index_add_(0, rows, update.to(weight.dtype))
    else:
        widened = weight.index_select(0, rows).to(update.dtype) + update
        weight.index_copy_(0, rows, widened.to(weight.dtype))
