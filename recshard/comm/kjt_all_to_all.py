"""KJTAllToAll: route each feature's ids to the rank that owns it, in two asynchronous stages.

Stage 1 (call): one small all-to-all of int64 metadata; row r of what this rank sends says,
for the keys going to rank r, their batch sizes (per key) and id counts (per key), this
rank's batch size, the dtypes of lengths / values / weights, and the validity verdict
(a flag plus the first line of the error message). Stage 2 (first `wait()`): checks every
rank's verdict and dtypes (so a bad batch on one rank stops every rank at once, before any
tensor is sent), then issues the lengths / values / weights all-to-alls. Second `wait()`:
reorders what arrived from rank-major to feature-major (`recat`) and returns the KJT.

Example (TorchRec's): keys A, B, C; `splits=[2, 1]`, two ranks with batch 3 each. Rank 0
receives A and B for batch positions `[rank 0's 3 | rank 1's 3]` (stride 6), rank 1 C.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from recshard.comm.request import Pending, issue_all_to_all, wait_work
from recshard.comm.verdict import MSG_WORDS, encode_message, raise_rejected
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from recshard.types import Awaitable

_DTYPES = [torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16,
           torch.float64, torch.int16, torch.int8, torch.uint8]
# Fixed columns of a metadata row: rejected flag, variable-batch flag, stride, 3 dtype codes.
_REJECTED, _VBE, _STRIDE, _LENGTHS_DTYPE, _VALUES_DTYPE, _WEIGHTS_DTYPE = range(6)
_FIXED = 6
_LABELS = ("lengths", "values", "weights")


def _dtype_code(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else _DTYPES.index(t.dtype) + 1 if t.dtype in _DTYPES else -1


def _dtype_name(code: int) -> str:
    return "none" if code == 0 else str(_DTYPES[code - 1]).replace("torch.", "")


def rank_order(num_splits: int, stagger: int) -> List[int]:
    """Source ranks in output batch order (stagger > 1 interleaves nodes, as TorchRec's TWRW)."""
    per_group = num_splits // stagger
    return [x + per_group * y for x in range(per_group) for y in range(stagger)]


def get_recat(
    local_split: int,
    num_splits: int,
    stagger: int = 1,
    device: Optional[torch.device] = None,
    batch_size_per_rank: Optional[List[int]] = None,
) -> torch.Tensor:
    """Permute from rank-major (what arrives) to feature-major (the output KJT), int32.

    Segment level `[F_local * W]` (output segment (f, j) = arrived segment
    `order[j] * F_local + f`) when every rank has the same batch size; bag level
    `[F_local * sum(B)]` when `batch_size_per_rank` differ (TorchRec's convention).
    """
    order = rank_order(num_splits, stagger)
    recat = [r * local_split + f for f in range(local_split) for r in order]
    recat_t = torch.tensor(recat, dtype=torch.int32, device=device)
    if batch_size_per_rank is None or len(set(batch_size_per_rank)) <= 1:
        return recat_t
    bags = [batch_size_per_rank[r] for r in range(num_splits) for _ in range(local_split)]
    return _expand(recat_t, torch.tensor(bags, dtype=torch.int32, device=device))


def _expand(segment_recat: torch.Tensor, segment_sizes: torch.Tensor) -> torch.Tensor:
    """A segment permute expanded to the elements of the segments (`segment_sizes`, source order)."""
    in_offsets = ops.asynchronous_complete_cumsum(segment_sizes)
    permuted = segment_sizes[segment_recat.long()]
    out_offsets = ops.asynchronous_complete_cumsum(permuted)
    return ops.expand_into_jagged_permute(
        segment_recat, in_offsets, out_offsets, int(permuted.sum())
    )


class KJTAllToAllTensorsAwaitable(Awaitable[KeyedJaggedTensor]):
    """Stage 2 in flight; `wait()` gives the feature-major KJT of this rank's keys.

    Metadata for sending per-id results back (`SequenceEmbeddingsAllToAll`):
      - `input_splits[label]`: elements sent to each rank (labels lengths, values, weights)
      - `output_splits[label]`: elements received from each rank
      - `stride_per_rank`: each source rank's batch size, by rank
      - `stride_per_key_per_rank`: `[F_local][W]` batch size of each local key from each rank
      - `recat`: rank-major -> feature-major permute (see `get_recat`)
      - `variable_stride`: batch sizes differ per rank or per key (then `recat` is per bag)
      - `values_per_key_per_rank`: `[F_local][W]` ids of each local key from each rank
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        keys: List[str],
        received: torch.Tensor,
        input_splits: Dict[str, List[int]],
        tensors: Dict[str, torch.Tensor],
        stagger: int,
    ) -> None:
        super().__init__()
        world_size = received.size(0)
        num_local = len(keys)
        self._keys, self._stagger, self._world_size = keys, stagger, world_size
        self._input_splits = input_splits
        self.stride_per_rank: List[int] = received[:, _STRIDE].tolist()
        strides = received[:, _FIXED: _FIXED + num_local]
        counts = received[:, _FIXED + num_local: _FIXED + 2 * num_local]
        self.stride_per_key_per_rank: List[List[int]] = strides.t().tolist()
        self.values_per_key_per_rank: List[List[int]] = counts.t().tolist()
        self._vbe = bool(received[:, _VBE].any())  # some rank has a batch size per key
        self.variable_stride = self._vbe or len(set(self.stride_per_rank)) > 1
        self._output_splits = {"lengths": strides.sum(1).tolist(), "values": counts.sum(1).tolist()}
        if "weights" in tensors:
            self._output_splits["weights"] = self._output_splits["values"]
        device = tensors["lengths"].device if tensors else torch.device("cpu")
        self._segment_strides = strides.reshape(-1).to(device)
        self._segment_counts = counts.reshape(-1).to(device)
        self._pending: Dict[str, Pending] = {}
        for label, tensor in tensors.items():
            if world_size == 1:
                self._pending[label] = Pending([], lambda t=tensor: t)
            else:
                self._pending[label] = issue_all_to_all(
                    tensor, input_splits[label], self._output_splits[label], pg,
                    name=f"kjt_all_to_all_{label}",
                )
        self._recat_cache: Optional[torch.Tensor] = None

    @property
    def input_splits(self) -> Dict[str, List[int]]:
        return self._input_splits

    @property
    def output_splits(self) -> Dict[str, List[int]]:
        return self._output_splits

    @property
    def _stride_per_rank(self) -> List[int]:  # TorchRec's attribute name
        return self.stride_per_rank

    def _segment_recat(self) -> torch.Tensor:
        device = self._segment_strides.device
        return get_recat(len(self._keys), self._world_size, self._stagger, device)

    @property
    def recat(self) -> torch.Tensor:
        """Segment-level permute when every rank has one batch size, else bag-level."""
        if self._recat_cache is None:
            segment = self._segment_recat()
            self._recat_cache = (
                _expand(segment, self._segment_strides) if self.variable_stride else segment
            )
        return self._recat_cache

    _recat = recat  # TorchRec's attribute name

    def _wait_impl(self) -> KeyedJaggedTensor:
        got = {label: pending.wait() for label, pending in self._pending.items()}
        lengths, values, weights = got["lengths"], got["values"], got.get("weights")
        num_local, world_size = len(self._keys), self._world_size
        order = rank_order(world_size, self._stagger)
        length_per_key = [sum(c) for c in self.values_per_key_per_rank]
        if num_local and lengths.numel() and world_size > 1:  # one rank: already feature-major
            recat = self._segment_recat()
            if not self.variable_stride:
                lengths, values, weights = ops.permute_2D_sparse_data(
                    recat, lengths.view(num_local * world_size, -1), values, weights,
                    sum(length_per_key),
                )
                lengths = lengths.reshape(-1)
            else:
                _, lengths, _ = ops.permute_1D_sparse_data(
                    recat, self._segment_strides, lengths, None, lengths.numel()
                )
                _, values, weights = ops.permute_1D_sparse_data(
                    recat, self._segment_counts, values, weights, values.numel()
                )
        spkpr = None
        if self._vbe:
            spkpr = [[row[r] for r in order] for row in self.stride_per_key_per_rank]
        return KeyedJaggedTensor(
            self._keys, values, weights, lengths=lengths,
            stride=None if spkpr else sum(self.stride_per_rank),
            stride_per_key_per_rank=spkpr, length_per_key=length_per_key, validate=False,
        )


class KJTAllToAllSplitsAwaitable(Awaitable[KJTAllToAllTensorsAwaitable]):
    """Stage 1 in flight; `wait()` checks every rank's verdict, then issues stage 2."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        kjt: KeyedJaggedTensor,
        splits: List[int],
        stagger: int,
        input_error: Optional[str],
    ) -> None:
        super().__init__()
        self._pg, self._splits, self._stagger = pg, splits, stagger
        self._rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self._input_error = input_error if input_error is not None else _check_input(kjt, splits)
        width = _FIXED + 2 * max(splits, default=0) + MSG_WORDS
        sent = torch.zeros(world_size, width, dtype=torch.int64)  # built on the host
        self._tensors: Dict[str, torch.Tensor] = {}
        self._input_splits: Dict[str, List[int]] = {}
        self._keys: List[str] = []
        if self._input_error is not None:
            sent[:, _REJECTED] = 1
            sent[:, width - MSG_WORDS:] = encode_message(self._input_error)
        else:
            self._fill(sent, kjt)
        if world_size == 1:
            self._received, self._work = sent, None
        else:  # NCCL needs device tensors; gloo takes host ones
            sent = sent.to(kjt.values().device if dist.get_backend(pg) == "nccl" else "cpu")
            self._received = torch.empty_like(sent)
            self._work = dist.all_to_all_single(self._received, sent, group=pg, async_op=True)

    def _fill(self, sent: torch.Tensor, kjt: KeyedJaggedTensor) -> None:
        """Metadata rows (one per destination) and the tensors to send in stage 2."""
        strides, counts = kjt.stride_per_key(), kjt.length_per_key()
        bounds = [sum(self._splits[:r]) for r in range(len(self._splits) + 1)]
        weights = kjt.weights_or_none()
        sent[:, _VBE] = int(kjt.variable_stride_per_key())
        sent[:, _STRIDE] = kjt.stride()
        sent[:, _LENGTHS_DTYPE] = _dtype_code(kjt.lengths())
        sent[:, _VALUES_DTYPE] = _dtype_code(kjt.values())
        sent[:, _WEIGHTS_DTYPE] = _dtype_code(weights)
        for r, num in enumerate(self._splits):
            lo, hi = bounds[r], bounds[r + 1]
            sent[r, _FIXED: _FIXED + num] = torch.tensor(strides[lo:hi], dtype=torch.int64)
            sent[r, _FIXED + num: _FIXED + 2 * num] = torch.tensor(counts[lo:hi], dtype=torch.int64)
        me = self._rank
        self._keys = kjt.keys()[bounds[me]: bounds[me + 1]]
        self._input_splits = {
            "lengths": [sum(strides[bounds[r]: bounds[r + 1]]) for r in range(len(self._splits))],
            "values": [sum(counts[bounds[r]: bounds[r + 1]]) for r in range(len(self._splits))],
        }
        self._tensors = {"lengths": kjt.lengths(), "values": kjt.values()}
        if weights is not None:
            self._input_splits["weights"] = self._input_splits["values"]
            self._tensors["weights"] = weights

    def _wait_impl(self) -> KJTAllToAllTensorsAwaitable:
        wait_work(self._work, "kjt_all_to_all_splits", pg=self._pg)
        received = self._received.cpu()
        raise_rejected(self._input_error, received[:, _REJECTED].tolist(),
                       received[:, -MSG_WORDS:])
        for column, label in zip((_LENGTHS_DTYPE, _VALUES_DTYPE, _WEIGHTS_DTYPE), _LABELS):
            codes = received[:, column].tolist()
            if len(set(codes)) > 1:
                per_rank = ", ".join(f"rank {r} {_dtype_name(c)}" for r, c in enumerate(codes))
                raise ValueError(f"KJTAllToAll: ranks disagree on the {label} dtype: {per_rank}")
        return KJTAllToAllTensorsAwaitable(
            self._pg, self._keys, received, self._input_splits, self._tensors, self._stagger
        )


def _check_input(kjt: KeyedJaggedTensor, splits: List[int]) -> Optional[str]:
    """What is wrong with this rank's input, or None."""
    keys = kjt.keys()
    if sum(splits) != len(keys):
        return (f"KJTAllToAll: splits {splits} sum to {sum(splits)} keys but the "
                f"KeyedJaggedTensor has {len(keys)}: {keys}")
    if kjt.values().is_floating_point() or kjt.lengths().is_floating_point():
        return (f"KJTAllToAll: ids and lengths must be integers, got values "
                f"{kjt.values().dtype} and lengths {kjt.lengths().dtype}")
    weights = kjt.weights_or_none()
    if weights is not None and not weights.is_floating_point():
        return f"KJTAllToAll: weights must be floating point, got {weights.dtype}"
    for name, t in (("lengths", kjt.lengths()), ("values", kjt.values()), ("weights", weights)):
        if t is not None and _dtype_code(t) < 0:
            return f"KJTAllToAll: unsupported {name} dtype {t.dtype}"
    return None


class KJTAllToAll(nn.Module):
    """Send keys `[sum(splits[:r]), sum(splits[:r+1]))` of every rank's KJT to rank r.

    `splits[r]`: number of keys rank r owns (same list on every rank). `stagger` > 1
    interleaves source ranks in the output batch (table-row-wise sharding). Call:
    `kjt_a2a(kjt, input_error=None)` -> `Awaitable[Awaitable[KeyedJaggedTensor]]`. A rank
    whose input is bad passes `input_error` (bad keys / dtypes are detected here too):
    the first `wait()` then raises `ValueError(input_error)` on it and
    `RuntimeError("rank R rejected its input: ...")` on every other rank.
    """

    def __init__(self, pg: dist.ProcessGroup, splits: List[int], stagger: int = 1) -> None:
        super().__init__()
        world_size = dist.get_world_size(pg)
        if len(splits) != world_size:
            raise ValueError(f"KJTAllToAll: splits {splits} need one entry per rank "
                             f"(world size {world_size})")
        if any(s < 0 for s in splits):
            raise ValueError(f"KJTAllToAll: splits {splits} must be non-negative")
        if stagger < 1 or world_size % stagger:
            raise ValueError(f"KJTAllToAll: stagger {stagger} must divide world size {world_size}")
        self._pg, self._splits, self._stagger = pg, list(splits), stagger

    def forward(
        self, input: KeyedJaggedTensor, input_error: Optional[str] = None
    ) -> KJTAllToAllSplitsAwaitable:
        with torch.no_grad():
            return KJTAllToAllSplitsAwaitable(
                self._pg, input, self._splits, self._stagger, input_error
            )
