"""KeyedJaggedTensor: sparse ids for several features, `[F keys, B batch, L jagged]`, key-major.

Layout (TorchRec's): `values` holds key 0's ids for batch positions 0..B-1, then key 1's, ...;
`lengths[k * B + b]` is the number of ids of key k at position b. With a variable batch per
key (`stride_per_key_per_rank`, one row per key, one column per source rank), key k owns
`stride_per_key[k] = sum(stride_per_key_per_rank[k])` consecutive entries of `lengths`.

Per-key sums (`length_per_key`, `offset_per_key`) need a host sync; they are computed once,
on first use or eagerly by `sync()`, and cached.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from recshard.sparse import jagged_ops as ops
from recshard.sparse.jagged_tensor import JaggedStorage, JaggedTensor
from recshard.sparse.keyed_tensor import offsets_from_sizes
from recshard.sparse.printing import kjt_repr, kjt_string
from recshard.sparse.validation import check_structure, validate_kjt


class KeyedJaggedTensor(JaggedStorage):
    """Ids (and optional per-id weights) of several features for one batch.

    Accepts what TorchRec's constructor accepts (no lengths/offsets with no keys, an empty
    `offsets`, values longer than the lengths' sum, 2-D values) after O(keys) checks
    (`validate=True`, see `check_structure`); `validate()` checks everything, and the
    embedding modules run it on their input where a cheap check fails.
    """

    def __init__(
        self,
        keys: List[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: List[List[int]] | torch.Tensor | None = None,
        stride_per_key: List[int] | None = None,
        length_per_key: List[int] | None = None,
        offset_per_key: List[int] | None = None,
        inverse_indices: Tuple[List[str], torch.Tensor] | None = None,
        validate: bool = True,
    ) -> None:
        if lengths is None and offsets is None:
            if keys:
                raise ValueError("KeyedJaggedTensor needs lengths or offsets")
            lengths = torch.empty(0, dtype=torch.int32, device=values.device)
        if isinstance(stride_per_key_per_rank, torch.Tensor):
            stride_per_key_per_rank = stride_per_key_per_rank.tolist()
        self._keys = list(keys)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride_per_key_per_rank = stride_per_key_per_rank
        self._inverse_indices = inverse_indices
        self._length_per_key = length_per_key
        self._offset_per_key = offset_per_key
        self._jt_dict: Dict[str, JaggedTensor] | None = None
        if stride_per_key_per_rank is not None:
            self._stride_per_key = stride_per_key or [sum(s) for s in stride_per_key_per_rank]
            if stride is None and inverse_indices is not None and inverse_indices[1].numel():
                stride = inverse_indices[1].size(-1)  # the deduplicated batch's size
            self._stride = max(self._stride_per_key, default=0) if stride is None else stride
        else:
            if stride is None:
                num_entries = (
                    lengths.numel() if lengths is not None else max(offsets.numel() - 1, 0)
                )
                stride = num_entries // len(self._keys) if self._keys else 0
            self._stride = stride
            self._stride_per_key = [stride] * len(self._keys)
        if validate:
            check_structure(self)

    # ------------------------------------------------------------------ constructors

    @staticmethod
    def from_lengths_sync(
        keys: List[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: List[List[int]] | None = None,
        inverse_indices: Tuple[List[str], torch.Tensor] | None = None,
        validate: bool = True,
    ) -> KeyedJaggedTensor:
        """Built from per-bag lengths, per-key sums computed now (one host sync)."""
        return KeyedJaggedTensor(
            keys,
            values,
            weights,
            lengths=lengths,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
            validate=validate,
        ).sync()

    @staticmethod
    def from_offsets_sync(
        keys: List[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: List[List[int]] | None = None,
        inverse_indices: Tuple[List[str], torch.Tensor] | None = None,
        validate: bool = True,
    ) -> KeyedJaggedTensor:
        """Built from bag offsets (`[0] + cumsum(lengths)`), per-key sums computed now."""
        return KeyedJaggedTensor(
            keys,
            values,
            weights,
            offsets=offsets,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
            validate=validate,
        ).sync()

    @staticmethod
    def from_jt_dict(jt_dict: Dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """One key per entry, in dict order. JaggedTensors of different batch sizes give a
        variable-batch KJT (`stride_per_key_per_rank = [[batch of key k]]`), as in TorchRec."""
        if not jt_dict:
            return KeyedJaggedTensor.empty()
        keys = list(jt_dict)
        jts = list(jt_dict.values())
        strides = [jt.lengths().numel() for jt in jts]
        has_weights = [jt.weights_or_none() is not None for jt in jts]
        if any(has_weights) and not all(has_weights):
            missing = [k for k, w in zip(keys, has_weights) if not w]
            raise ValueError(f"from_jt_dict: keys {missing} have no weights but others do")
        weights = torch.cat([jt.weights() for jt in jts]) if all(has_weights) else None
        variable = len(set(strides)) > 1
        return KeyedJaggedTensor.from_lengths_sync(
            keys,
            torch.cat([jt.values() for jt in jts]),
            torch.cat([jt.lengths() for jt in jts]),
            weights,
            stride=None if variable else strides[0],
            stride_per_key_per_rank=[[s] for s in strides] if variable else None,
        )

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> KeyedJaggedTensor:
        """No keys; values and weights of torch's default dtype unless given (TorchRec's)."""
        return KeyedJaggedTensor(
            [],
            torch.empty(0, dtype=values_dtype, device=device),
            torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
            validate=False,
        )

    @staticmethod
    def empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """No keys and no ids, with `kjt`'s dtypes, device and batch size(s)."""
        weights = kjt.weights_or_none()
        return KeyedJaggedTensor(
            [],
            torch.empty(0, dtype=kjt.values().dtype, device=kjt.device()),
            None if weights is None else torch.empty(0, dtype=weights.dtype, device=kjt.device()),
            lengths=torch.empty(0, dtype=kjt.lengths().dtype, device=kjt.device()),
            stride=kjt.stride(),
            stride_per_key_per_rank=kjt._stride_per_key_per_rank,
            validate=False,
        )

    @staticmethod
    def concat(kjts: List[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Keys of all inputs side by side (inputs must share the batch size unless variable)."""
        return concat_kjts(kjts)

    # ------------------------------------------------------------------ accessors

    def keys(self) -> List[str]:
        return self._keys

    def stride(self) -> int:
        return self._stride

    def stride_per_key(self) -> List[int]:
        return self._stride_per_key

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key_per_rank is not None

    def stride_per_key_per_rank(self) -> List[List[int]]:
        """Batch size of each key from each source rank; `[]` unless variable (TorchRec's)."""
        if self._stride_per_key_per_rank is None:
            return []
        return self._stride_per_key_per_rank

    def inverse_indices_or_none(self) -> Tuple[List[str], torch.Tensor] | None:
        return self._inverse_indices

    def inverse_indices(self) -> Tuple[List[str], torch.Tensor]:
        if self._inverse_indices is None:
            raise ValueError("this KeyedJaggedTensor has no inverse_indices")
        return self._inverse_indices

    def index_per_key(self) -> Dict[str, int]:
        """Position of each key in `keys()`."""
        return {key: i for i, key in enumerate(self._keys)}

    def lengths_offset_per_key(self) -> List[int]:
        """Where each key's block starts in `lengths` (cumsum of stride_per_key)."""
        return offsets_from_sizes(self._stride_per_key)

    def length_per_key(self) -> List[int]:
        """Number of ids of each key (one host sync on first call, then cached). On `meta`
        (no data) the values split evenly, the remainder to the first key, as TorchRec's."""
        if self._length_per_key is None:
            if not self._keys:
                self._length_per_key = []
            elif self._values.is_meta:  # no data: an even split of values (TorchRec's stand-in)
                share, rest = divmod(self._values.numel(), len(self._keys))
                self._length_per_key = [share + rest] + [share] * (len(self._keys) - 1)
            elif not self.variable_stride_per_key():
                lengths = self.lengths()
                self._length_per_key = (
                    lengths.view(len(self._keys), -1).sum(dim=1).tolist()
                    if lengths.numel()
                    else [0] * len(self._keys)
                )
            else:
                offsets = self.offsets()
                boundaries = torch.tensor(
                    self.lengths_offset_per_key(), dtype=torch.long, device=offsets.device
                )
                at = offsets.index_select(0, boundaries)
                self._length_per_key = (at[1:] - at[:-1]).tolist()
        return self._length_per_key

    def offset_per_key(self) -> List[int]:
        """Where each key's ids start in `values`, plus the total at the end."""
        if self._offset_per_key is None:
            self._offset_per_key = offsets_from_sizes(self.length_per_key())
        return self._offset_per_key

    def validate(self) -> None:
        """Every consistency check (ValueError naming key and numbers); see `validate_kjt`."""
        validate_kjt(self)

    def sync(self) -> KeyedJaggedTensor:
        """Compute and cache the per-key sums now (one host sync)."""
        self.offset_per_key()
        return self

    def unsync(self) -> KeyedJaggedTensor:
        """Forget the cached per-key sums; the next use recomputes them (TorchRec's)."""
        self._length_per_key = None
        self._offset_per_key = None
        return self

    # ------------------------------------------------------------------ ops

    def _with(
        self,
        keys: List[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor,
        stride_per_key_per_rank: List[List[int]] | None,
        length_per_key: List[int] | None,
    ) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys,
            values,
            weights,
            lengths=lengths,
            stride=self._stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            length_per_key=length_per_key,
            validate=False,
        )

    def permute(
        self, indices: Sequence[int], indices_tensor: torch.Tensor | None = None
    ) -> KeyedJaggedTensor:
        """Keys in the order `indices` (indices may repeat a key or leave one out)."""
        indices = list(indices)
        num_keys = len(self._keys)
        bad = [i for i in indices if not 0 <= i < num_keys]
        if bad:
            raise ValueError(f"permute: indices {bad} out of range for {num_keys} keys")
        if indices_tensor is None:
            indices_tensor = torch.tensor(indices, dtype=torch.int32, device=self._values.device)
        lpk = self.length_per_key()
        new_lpk = [lpk[i] for i in indices]
        keys = [self._keys[i] for i in indices]
        if not self.variable_stride_per_key():
            lengths, values, weights = ops.permute_2D_sparse_data(
                indices_tensor,
                self.lengths().view(num_keys, -1),
                self._values,
                self._weights,
                sum(new_lpk),
            )
            return self._with(keys, values, weights, lengths.reshape(-1), None, new_lpk)
        # Variable batch: permute lengths by per-key stride segments, values by per-key sums.
        device = self._values.device
        strides = torch.tensor(self._stride_per_key, dtype=torch.long, device=device)
        _, lengths, _ = ops.permute_1D_sparse_data(
            indices_tensor,
            strides,
            self.lengths(),
            None,
            sum(self._stride_per_key[i] for i in indices),
        )
        counts = torch.tensor(lpk, dtype=torch.long, device=device)
        _, values, weights = ops.permute_1D_sparse_data(
            indices_tensor, counts, self._values, self._weights, sum(new_lpk)
        )
        spkpr = [self._stride_per_key_per_rank[i] for i in indices]
        return self._with(keys, values, weights, lengths, spkpr, new_lpk)

    def flatten_lengths(self) -> KeyedJaggedTensor:
        """The same batch with `lengths` as one 1-D tensor (TorchRec's)."""
        return self._with(
            self._keys,
            self._values,
            self._weights,
            self.lengths().view(-1),
            self._stride_per_key_per_rank,
            self.length_per_key(),
        )

    def split(self, segments: Sequence[int]) -> List[KeyedJaggedTensor]:
        """Consecutive groups of `segments[i]` keys, as views of this tensor's storage."""
        if sum(segments) != len(self._keys):
            raise ValueError(
                f"split: segments {list(segments)} sum to {sum(segments)}, "
                f"but there are {len(self._keys)} keys"
            )
        opk, lopk = self.offset_per_key(), self.lengths_offset_per_key()
        lpk = self.length_per_key()
        out, start = [], 0
        for seg in segments:
            end = start + seg
            if seg == 0:  # TorchRec's: no keys, empty int32 lengths and offsets
                out.append(self._no_keys())
                continue
            v0, v1 = opk[start], opk[end]
            l0, l1 = lopk[start], lopk[end]
            out.append(
                self._with(
                    self._keys[start:end],
                    self._values[v0:v1],
                    None if self._weights is None else self._weights[v0:v1],
                    self.lengths().reshape(-1)[l0:l1],
                    None
                    if self._stride_per_key_per_rank is None
                    else self._stride_per_key_per_rank[start:end],
                    lpk[start:end],
                )
            )
            start = end
        return out

    def _no_keys(self) -> KeyedJaggedTensor:
        no_rows = torch.empty(0, dtype=torch.int32, device=self._values.device)
        return KeyedJaggedTensor(
            [],
            self._values[:0],
            None if self._weights is None else self._weights[:0],
            lengths=no_rows,
            offsets=no_rows,
            stride=self._stride,
            stride_per_key_per_rank=None if self._stride_per_key_per_rank is None else [],
            validate=False,
        )

    def __getitem__(self, key: str) -> JaggedTensor:
        try:
            index = self._keys.index(key)
        except ValueError:
            raise KeyError(f"KeyedJaggedTensor has no key '{key}' (keys: {self._keys})") from None
        return self._jagged(index)

    def _jagged(self, index: int) -> JaggedTensor:
        opk, lopk = self.offset_per_key(), self.lengths_offset_per_key()
        v0, v1 = opk[index], opk[index + 1]
        return JaggedTensor(
            self._values[v0:v1],
            None if self._weights is None else self._weights[v0:v1],
            # reshape: TorchRec accepts lengths as [keys, batch] too; slice them flat
            lengths=self.lengths().reshape(-1)[lopk[index] : lopk[index + 1]],
        )

    def to_dict(self) -> Dict[str, JaggedTensor]:
        """One JaggedTensor per key. A fixed batch of 0 gives each key empty lengths *and*
        offsets, TorchRec's form (as `JaggedTensor.empty`; `kjt[key]` has offsets `[0]`)."""
        if self._jt_dict is None:
            if not self.variable_stride_per_key() and not self.lengths().numel():
                self._jt_dict = {key: self._empty_batch(i) for i, key in enumerate(self._keys)}
            else:
                self._jt_dict = {key: self._jagged(i) for i, key in enumerate(self._keys)}
        return self._jt_dict

    def _empty_batch(self, index: int) -> JaggedTensor:
        jt = self._jagged(index)
        no_rows = jt.lengths().reshape(0)
        return JaggedTensor(jt.values(), jt.weights_or_none(), lengths=no_rows, offsets=no_rows)

    def _map(self, fn) -> KeyedJaggedTensor:  # noqa: ANN001 - tensor -> tensor
        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        inverse = self._inverse_indices
        return KeyedJaggedTensor(
            self._keys,
            apply(self._values),
            apply(self._weights),
            lengths=apply(self._lengths),
            offsets=apply(self._offsets),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            length_per_key=self._length_per_key,
            offset_per_key=self._offset_per_key,
            inverse_indices=None if inverse is None else (inverse[0], fn(inverse[1])),
            validate=False,
        )

    def to(
        self, device: torch.device, non_blocking: bool = False, dtype: torch.dtype | None = None
    ) -> KeyedJaggedTensor:
        moved = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        if dtype is not None and moved._weights is not None:
            moved._weights = moved._weights.to(dtype)
        return moved

    def pin_memory(self) -> KeyedJaggedTensor:
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None and t.is_cuda:
                t.record_stream(stream)

    def device(self) -> torch.device:
        """A method, as TorchRec's (`kjt.device()`)."""
        return self._values.device

    def __str__(self) -> str:
        return kjt_string(self)

    def __repr__(self) -> str:
        return kjt_repr(self)


@torch.fx.wrap
def concat_kjts(kjts: List[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """`KeyedJaggedTensor.concat`; a leaf in torch.fx traces (the list may be a placeholder),
    as TorchRec's `_kjt_concat`."""
    if not kjts:
        raise ValueError("concat needs at least one KeyedJaggedTensor")
    weighted = [k.weights_or_none() is not None for k in kjts]
    if any(weighted) and not all(weighted):
        raise ValueError("concat: either all or none of the KeyedJaggedTensors carry weights")
    variable = any(k.variable_stride_per_key() for k in kjts)
    strides = {k.stride() for k in kjts if k.keys()}
    if not variable and len(strides) > 1:
        raise ValueError(f"concat: batch sizes differ ({sorted(strides)}); use variable batch")
    spkpr = None
    if variable:
        spkpr = [
            row
            for k in kjts
            for row in (k.stride_per_key_per_rank() or [[s] for s in k.stride_per_key()])
        ]
    return KeyedJaggedTensor(
        [key for k in kjts for key in k.keys()],
        torch.cat([k.values() for k in kjts]),
        torch.cat([k.weights() for k in kjts]) if all(weighted) else None,
        lengths=torch.cat([k.lengths() for k in kjts]),
        stride=None if variable else next(iter(strides), 0),
        stride_per_key_per_rank=spkpr,
        length_per_key=[n for k in kjts for n in k.length_per_key()],
        validate=False,
    )
