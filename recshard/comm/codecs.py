"""Comm codecs: shrink what the pooled / sequence collectives send (fp16, bf16), both ways.

A codec `encode`s a tensor before it is sent and `decode`s what arrives; split sizes
are counted in elements of `quantized_dtype` (`calc_quantized_size`). A collective takes
`QuantizedCommCodecs(forward, backward)`: the forward codec for the embeddings, the
backward one for their gradients. `get_qcomm_codecs_registry("fp16")` builds the
per-`CommOp` registry that sharders take as `qcomm_codecs_registry`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Protocol, Tuple, runtime_checkable

import torch


class CommOp(enum.Enum):
    """The collectives a codec can be attached to (registry keys are the member names)."""

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"


class CommType(enum.Enum):
    """Wire precision of a collective."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


@runtime_checkable
class QuantizedCommCodec(Protocol):
    """Encodes a tensor for the wire and decodes it on arrival (TorchRec's protocol)."""

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor: ...

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor: ...

    @property
    def quantized_dtype(self) -> torch.dtype: ...

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int: ...

    def create_context(self) -> Any | None: ...


class NoOpQuantizedCommCodec:
    """Sends tensors as they are."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self._dtype = dtype

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        return input_tensor

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        return input_grad

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self._dtype

    def calc_quantized_size(self, input_len: int, ctx: Any | None = None) -> int:
        return input_len

    def create_context(self) -> Any | None:
        return None

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: List[int], my_rank: int, ctx: Any
    ) -> Tuple[int, int]:
        """(local dim after padding, padding added): casts never pad."""
        return input_tensor.size(1) if input_tensor.dim() == 2 else input_tensor.numel(), 0

    def cast_to(self, dtype: torch.dtype) -> torch.dtype | None:
        """The wire dtype of a `dtype` tensor when encode and decode are plain casts (None
        otherwise): a collective may then cast inside the copies it makes anyway, instead of in
        passes of their own. This codec sends tensors as they are."""
        return dtype


class CastCommCodec(NoOpQuantizedCommCodec):
    """Sends tensors cast to a narrower float dtype; decodes back to `output_dtype`.

    `loss_scale` multiplies before the cast and divides after it, so small gradients
    survive fp16 (whose smallest normal is 6e-5).
    """

    def __init__(
        self,
        wire_dtype: torch.dtype,
        output_dtype: torch.dtype = torch.float32,
        loss_scale: float | None = None,
    ) -> None:
        super().__init__(wire_dtype)
        self._output_dtype = output_dtype
        self._loss_scale = loss_scale

    def encode(self, input_tensor: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        if self._loss_scale is not None:
            input_tensor = input_tensor * self._loss_scale
        return input_tensor.to(self._dtype)

    def decode(self, input_grad: torch.Tensor, ctx: Any | None = None) -> torch.Tensor:
        output = input_grad.to(self._output_dtype)
        if self._loss_scale is not None:
            output = output / self._loss_scale
        return output

    def cast_to(self, dtype: torch.dtype) -> torch.dtype | None:
        plain = self._loss_scale is None and dtype == self._output_dtype
        return self._dtype if plain else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(loss_scale={self._loss_scale})"


class FP16CommCodec(CastCommCodec):
    """fp32 on both ends, fp16 on the wire (half the bytes)."""

    def __init__(self, loss_scale: float | None = None) -> None:
        super().__init__(torch.float16, loss_scale=loss_scale)


class BF16CommCodec(CastCommCodec):
    """fp32 on both ends, bf16 on the wire: half the bytes, fp32's range, 8 bits of mantissa."""

    def __init__(self, loss_scale: float | None = None) -> None:
        super().__init__(torch.bfloat16, loss_scale=loss_scale)


@dataclass
class QuantizedCommCodecs:
    """The codec for a collective's forward (embeddings) and its backward (gradients)."""

    forward: QuantizedCommCodec = field(default_factory=NoOpQuantizedCommCodec)
    backward: QuantizedCommCodec = field(default_factory=NoOpQuantizedCommCodec)


def _comm_type(precision: str | CommType) -> CommType:
    if isinstance(precision, CommType):
        return precision
    try:
        return CommType(precision.lower())
    except ValueError:
        names = [t.value for t in CommType]
        raise ValueError(f"unknown comm precision {precision!r}; expected one of {names}") from None


def codec_for(precision: str | CommType, loss_scale: float | None = None) -> QuantizedCommCodec:
    """The codec that sends at `precision` ("fp32", "fp16", "bf16")."""
    comm_type = _comm_type(precision)
    if comm_type is CommType.FP16:
        return FP16CommCodec(loss_scale)
    if comm_type is CommType.BF16:
        return BF16CommCodec(loss_scale)
    return NoOpQuantizedCommCodec()


@dataclass
class QCommsConfig:
    """Wire precision of the forward and backward collectives (TorchRec's config)."""

    forward_precision: str | CommType = CommType.FP32
    backward_precision: str | CommType = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None

    def __post_init__(self) -> None:
        self.forward_precision = _comm_type(self.forward_precision)
        self.backward_precision = _comm_type(self.backward_precision)


def get_qcomm_codecs(qcomms_config: QCommsConfig | None) -> QuantizedCommCodecs:
    if qcomms_config is None:
        return QuantizedCommCodecs()
    return QuantizedCommCodecs(
        forward=codec_for(qcomms_config.forward_precision, qcomms_config.forward_loss_scale),
        backward=codec_for(qcomms_config.backward_precision, qcomms_config.backward_loss_scale),
    )


def get_qcomm_codecs_registry(
    qcomms_config: QCommsConfig | str | None,
    comm_ops: List[CommOp] | None = None,
    device: torch.device | None = None,
) -> Dict[str, QuantizedCommCodecs] | None:
    """`{CommOp.name: QuantizedCommCodecs}` for every comm op (or `comm_ops`).

    `qcomms_config` is a `QCommsConfig` or a precision name ("fp16" sends both the
    embeddings and their gradients in fp16). None or "fp32" gives None: no codecs.
    `device` is accepted for TorchRec compatibility (casts need no device state).
    """
    if isinstance(qcomms_config, str):
        qcomms_config = QCommsConfig(qcomms_config, qcomms_config)
    if qcomms_config is None or (
        qcomms_config.forward_precision is CommType.FP32
        and qcomms_config.backward_precision is CommType.FP32
    ):
        return None
    return {op.name: get_qcomm_codecs(qcomms_config) for op in comm_ops or list(CommOp)}


def cast_dtype(codec: QuantizedCommCodec | None, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a tensor of `dtype` travels in when `codec` (None: no codec) only casts it; None
    when the codec does more (scales, quantizes) or is not one of recshard's."""
    if codec is None:
        return dtype
    cast_to = getattr(codec, "cast_to", None)
    return cast_to(dtype) if cast_to is not None else None


def codecs_from_registry(
    registry: Dict[str, QuantizedCommCodecs] | None, op: CommOp
) -> QuantizedCommCodecs | None:
    """The codecs of `op` in a sharder's `qcomm_codecs_registry`, if any."""
    return registry.get(op.name) if registry else None
