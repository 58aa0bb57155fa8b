"""JaggedTensor: a batch of variable-length rows, `[B, *]`, stored as values + lengths/offsets."""

from __future__ import annotations

from typing import List

import torch

from recshard.sparse import jagged_ops as ops
from recshard.sparse.printing import jt_string
from recshard.sparse.traceable import TraceableConstruction

INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def lengths_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def check_index_dtype(tensor: torch.Tensor | None, name: str, owner: str) -> None:
    """lengths / offsets count values: a non-empty one must hold integers (O(1) check)."""
    if tensor is not None and tensor.numel() and tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{owner}: {name} must be of integer type, got {tensor.dtype}")


@torch.fx.wrap
def masked_or_none(tensor: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """`tensor[mask]`, or None without a tensor. A leaf in torch.fx traces (TorchRec's
    `_optional_mask`): traced with `weights` as a placeholder, None is only known at run time."""
    return None if tensor is None else tensor[mask]


class JaggedStorage(metaclass=TraceableConstruction):
    """values / weights / lengths / offsets, with lengths and offsets derived from each other
    on first use and cached. Shared by JaggedTensor and KeyedJaggedTensor.

    Built from symbolic values inside a torch.fx trace, a sparse type becomes one graph node
    (`TraceableConstruction`, as TorchRec's), so models that build KJTs in `forward` trace."""

    _values: torch.Tensor
    _weights: torch.Tensor | None
    _lengths: torch.Tensor | None
    _offsets: torch.Tensor | None

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError(f"this {type(self).__name__} has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            self._lengths = lengths_from_offsets(self._offsets)
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = ops.asynchronous_complete_cumsum(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets


class JaggedTensor(JaggedStorage):
    """Rows of different lengths: row i is `values[offsets[i]:offsets[i+1]]`.

    values: `[N]` (ids) or `[N, D]` (embeddings); lengths: `[B]`; offsets: `[B+1]`;
    weights: optional `[N]`, one per value. At least one of lengths/offsets is given; the
    other is derived on first use and cached.
    """

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise ValueError("JaggedTensor needs lengths or offsets")
        check_index_dtype(lengths, "lengths", "JaggedTensor")
        check_index_dtype(offsets, "offsets", "JaggedTensor")
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets

    @staticmethod
    def from_dense(
        values: List[torch.Tensor], weights: List[torch.Tensor] | None = None
    ) -> JaggedTensor:
        """Build from one tensor per row (no rows: torch's default dtype, as `empty()`)."""
        device = values[0].device if values else torch.device("cpu")
        lengths = torch.tensor([v.size(0) for v in values], dtype=torch.int32, device=device)
        flat = torch.cat(values) if values else torch.empty(0, device=device)
        flat_weights = torch.cat(weights) if weights else None
        return JaggedTensor(flat, flat_weights, lengths=lengths)

    @staticmethod
    def from_dense_lengths(
        values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> JaggedTensor:
        """Row i is the first `lengths[i]` entries of `values[i]` (`values`: `[B, L, ...]`)."""
        keep = torch.arange(values.size(1), device=values.device) < lengths.unsqueeze(-1)
        return JaggedTensor(values[keep], masked_or_none(weights, keep), lengths=lengths)

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> JaggedTensor:
        """No rows (TorchRec's signature: `values_dtype` None is torch's default dtype)."""
        return JaggedTensor(
            torch.empty(0, dtype=values_dtype, device=device),
            torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            offsets=torch.empty(0, dtype=lengths_dtype, device=device),
        )

    @staticmethod
    def empty_like(jt: JaggedTensor, device: torch.device | None = None) -> JaggedTensor:
        """No rows, `jt`'s dtypes; with `device`, uninitialized tensors of `jt`'s shapes there."""
        if device is None:
            weights = jt.weights_or_none()
            return JaggedTensor(
                torch.empty(0, dtype=jt.values().dtype, device=jt.device()),
                None
                if weights is None
                else torch.empty(0, dtype=weights.dtype, device=jt.device()),
                lengths=torch.empty(0, dtype=jt.lengths().dtype, device=jt.device()),
            )

        def like(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.empty_like(t, device=device)

        return JaggedTensor(
            like(jt.values()),
            like(jt.weights_or_none()),
            like(jt.lengths_or_none()),
            like(jt.offsets_or_none()),
        )

    def device(self) -> torch.device:
        return self._values.device

    def to_dense(self) -> List[torch.Tensor]:
        """One tensor per row."""
        return list(torch.split(self._values, self.lengths().tolist()))

    def to_dense_weights(self) -> List[torch.Tensor] | None:
        if self._weights is None:
            return None
        return list(torch.split(self._weights, self.lengths().tolist()))

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """`[B, L]` (or `[B, L, D]`): rows cut or padded to `desired_length` (default: longest)."""
        lengths = self.lengths()
        if desired_length is None:
            desired_length = int(lengths.max().item()) if lengths.numel() else 0
        return ops.jagged_to_padded_dense(
            self._values, self.offsets(), desired_length, padding_value
        )

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        """`to_padded_dense` of the weights (None when there are none)."""
        if self._weights is None:
            return None
        lengths = self.lengths()
        if desired_length is None:
            desired_length = int(lengths.max().item()) if lengths.numel() else 0
        return ops.jagged_to_padded_dense(
            self._weights, self.offsets(), desired_length, padding_value
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> JaggedTensor:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return JaggedTensor(
            move(self._values), move(self._weights), move(self._lengths), move(self._offsets)
        )

    def pin_memory(self) -> JaggedTensor:
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return JaggedTensor(
            pin(self._values), pin(self._weights), pin(self._lengths), pin(self._offsets)
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None and t.is_cuda:
                t.record_stream(stream)

    def __str__(self) -> str:
        return jt_string(self)

    def __repr__(self) -> str:
        rows = [r.tolist() for r in self.to_dense()]
        weights = self.to_dense_weights()
        extra = f", weights={[w.tolist() for w in weights]}" if weights is not None else ""
        return f"JaggedTensor({rows}{extra})"
