"""KJTAllToAll: route each feature's ids to the rank that owns it, in two asynchronous stages.

Stage 1 (call): one small all-to-all of int64 metadata, a row per destination
(`kjt_metadata.py`: batch sizes and id counts per key, dtypes, the lengths' range, the
validity verdict). Stage 2 (first `wait()`): checks every rank's verdict and dtypes (so a bad
batch on one rank stops every rank at once, before any tensor is sent), then issues the ids
all-to-all (lengths and ids, one buffer) and, with weights, the weights all-to-all.
Second `wait()`: reorders what arrived from rank-major to feature-major (`recat`) and returns
the KJT.

On the wire (`comm/wire.py`), what a rank sends to rank r is one packed buffer: the lengths of
r's keys in the narrowest type that holds the sender's lengths (its range came in stage 1, so
r knows the type), then each key's ids, in the narrowest type for `rows` when the caller told
`set_id_rows` that the key's ids lie in `[0, rows)`; weights packed per key beside them, in a
second all-to-all. All cast back to the sender's dtypes on arrival.

Example (TorchRec's): keys A, B, C; `splits=[2, 1]`, two ranks with batch 3 each. Rank 0
receives A and B for batch positions `[rank 0's 3 | rank 1's 3]` (stride 6), rank 1 C.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from recshard.comm.kjt_metadata import (
    FIXED,
    LENGTHS_MAX,
    LENGTHS_MIN,
    REJECTED,
    STRIDE,
    VBE,
    Selected,
    check_dtypes_agree,
    check_input,
    fill_metadata,
    select_keys,
)
from recshard.comm.pg import HoldsGroup
from recshard.comm.recat import expand_recat, get_recat, rank_order
from recshard.comm.request import Pending, issue_all_to_all, wait_work
from recshard.comm.verdict import MSG_WORDS, encode_message, raise_rejected
from recshard.comm.wire import (
    Segment,
    id_wire_dtype,
    lengths_wire_dtype,
    pack,
    pack_segments,
    segment_bytes,
    unpack,
)
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from recshard.types import Awaitable


@dataclass
class Outgoing:
    """What this rank sends in stage 2 and how what it receives is laid out.

    `input_splits[label]`: elements per destination. With other ranks, `values` is the packed
    lengths and ids (`weights` the packed weights) per destination (`wire.pack_segments`),
    `wire_splits[label]` bytes per destination, and `local_id_dtypes` is how the ids of each
    key this rank receives travel.
    """

    keys: List[str]  # the keys this rank receives
    input_splits: Dict[str, List[int]]
    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    wire_splits: Dict[str, List[int]]
    local_id_dtypes: List[torch.dtype]
    dtypes: Dict[str, torch.dtype]  # lengths / values / weights as every rank holds them


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
        received: torch.Tensor,
        sent: Outgoing,
        stagger: int,
    ) -> None:
        super().__init__()
        world_size = received.size(0)
        num_local = len(sent.keys)
        self._keys, self._stagger, self._world_size = sent.keys, stagger, world_size
        self._dtypes = sent.dtypes
        self._input_splits = sent.input_splits
        self.stride_per_rank: List[int] = received[:, STRIDE].tolist()
        strides = received[:, FIXED : FIXED + num_local]
        counts = received[:, FIXED + num_local : FIXED + 2 * num_local]
        self.stride_per_key_per_rank: List[List[int]] = strides.t().tolist()
        self.values_per_key_per_rank: List[List[int]] = counts.t().tolist()
        self._vbe = bool(received[:, VBE].any())  # some rank has a batch size per key
        self.variable_stride = self._vbe or len(set(self.stride_per_rank)) > 1
        self._output_splits = {"lengths": strides.sum(1).tolist(), "values": counts.sum(1).tolist()}
        if sent.weights is not None:
            self._output_splits["weights"] = self._output_splits["values"]
        device = sent.lengths.device
        self._segment_strides = strides.reshape(-1).to(device)
        # the segments as they arrive, rank-major: from each rank its lengths (in the type its
        # range picks), then each key's ids in their wire dtype; weights per key
        lengths_dtypes = [
            lengths_wire_dtype(low, high, sent.dtypes["lengths"])
            for low, high in received[:, [LENGTHS_MIN, LENGTHS_MAX]].tolist()
        ]
        self._arrived_counts = {"values": [], "weights": counts.reshape(-1).tolist()}
        self._arrived_dtypes = {"values": []}
        for r, rank_counts in enumerate(counts.tolist()):
            self._arrived_counts["values"] += [self._output_splits["lengths"][r]] + rank_counts
            self._arrived_dtypes["values"] += [lengths_dtypes[r]] + sent.local_id_dtypes
        if sent.weights is not None:
            self._arrived_dtypes["weights"] = [sent.dtypes["weights"]] * world_size * num_local
        self._recat_cache: torch.Tensor | None = None
        self._pending: Dict[str, Pending] = {}
        if world_size == 1:  # nothing to send: the input is already feature-major
            self._pending = {
                label: Pending([], lambda t=t: t)
                for label, t in (
                    ("lengths", sent.lengths),
                    ("values", sent.values),
                    ("weights", sent.weights),
                )
                if t is not None
            }
            return
        for label, packed in (("values", sent.values), ("weights", sent.weights)):
            if packed is not None:
                self._pending[label] = issue_all_to_all(
                    packed,
                    sent.wire_splits[label],
                    self._arrived_bytes(label),
                    pg,
                    name=f"kjt_all_to_all_{label}",
                )

    def _arrived_bytes(self, label: str) -> List[int]:
        """Packed bytes of `label` from each rank."""
        sizes = [
            segment_bytes(n, d)
            for n, d in zip(self._arrived_counts[label], self._arrived_dtypes[label])
        ]
        per_rank = len(sizes) // self._world_size
        return [sum(sizes[r * per_rank : (r + 1) * per_rank]) for r in range(self._world_size)]

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
                expand_recat(segment, self._segment_strides) if self.variable_stride else segment
            )
        return self._recat_cache

    _recat = recat  # TorchRec's attribute name

    def _unpack(
        self, wire: torch.Tensor, label: str, dtype_label: str, order: List[int]
    ) -> torch.Tensor:
        """Segments `order` of `label`'s packed buffer, cast back to the senders' dtype."""
        return unpack(
            wire,
            self._arrived_counts[label],
            self._arrived_dtypes[label],
            self._dtypes[dtype_label],
            order,
            f"kjt_all_to_all_{dtype_label}_unpacked",
        )

    def _wait_impl(self) -> KeyedJaggedTensor:
        num_local, world_size = len(self._keys), self._world_size
        if world_size == 1:
            lengths = self._pending["lengths"].wait()
            values = self._pending["values"].wait()
            weights = self._pending["weights"].wait() if "weights" in self._pending else None
        else:
            recat = self._segment_recat()
            order = recat.tolist()
            wire = self._pending["values"].wait()
            # segment r * F + f of the recat is rank r's key f, after rank r's lengths
            lengths = self._unpack(
                wire, "values", "lengths", [r * (num_local + 1) for r in range(world_size)]
            )
            values = self._unpack(wire, "values", "values", [i + i // num_local + 1 for i in order])
            weights = (
                self._unpack(self._pending["weights"].wait(), "weights", "weights", order)
                if "weights" in self._pending
                else None
            )
            if lengths.numel() and not self.variable_stride:
                lengths = lengths.view(num_local * world_size, -1).index_select(0, recat).view(-1)
            elif lengths.numel():
                _, lengths, _ = ops.permute_1D_sparse_data(
                    recat, self._segment_strides, lengths, None, lengths.numel()
                )
        spkpr = None
        if self._vbe:
            order_ranks = rank_order(world_size, self._stagger)
            spkpr = [[row[r] for r in order_ranks] for row in self.stride_per_key_per_rank]
        return KeyedJaggedTensor(
            self._keys,
            values,
            weights,
            lengths=lengths,
            stride=None if spkpr else sum(self.stride_per_rank),
            stride_per_key_per_rank=spkpr,
            length_per_key=[sum(c) for c in self.values_per_key_per_rank],
            validate=False,
        )


class KJTAllToAllSplitsAwaitable(Awaitable[KJTAllToAllTensorsAwaitable]):
    """Stage 1 in flight; `wait()` checks every rank's verdict, then issues stage 2."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        kjt: KeyedJaggedTensor,
        splits: List[int],
        stagger: int,
        input_error: str | None,
        id_rows: Sequence[int | None],
        key_order: List[int] | None = None,
    ) -> None:
        super().__init__()
        self._pg, self._splits, self._stagger = pg, splits, stagger
        self._rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
        if input_error is None:
            input_error = check_input(kjt, splits, key_order)
        self._input_error = input_error
        self._bounds = [sum(splits[:r]) for r in range(len(splits) + 1)]  # key ranges by rank
        width = FIXED + 2 * max(splits, default=0) + MSG_WORDS
        sent = torch.zeros(world_size, width, dtype=torch.int64, device="cpu")  # built on the host
        if self._input_error is not None:
            sent[:, REJECTED] = 1
            sent[:, width - MSG_WORDS :] = encode_message(self._input_error)
        else:
            selected = select_keys(kjt, key_order)
            fill_metadata(sent, kjt, selected, splits)
        if world_size == 1:
            self._received, self._work = sent, None
        else:  # NCCL needs device tensors; gloo takes host ones
            wire = sent.to(kjt.values().device if dist.get_backend(pg) == "nccl" else "cpu")
            self._received = torch.empty_like(wire)
            self._work = dist.all_to_all_single(self._received, wire, group=pg, async_op=True)
        # packing the lengths and ids overlaps the splits exchange
        self._outgoing = None
        if self._input_error is None:
            lengths_dtype = lengths_wire_dtype(
                int(sent[0, LENGTHS_MIN]), int(sent[0, LENGTHS_MAX]), kjt.lengths().dtype
            )
            self._outgoing = self._pack(kjt, selected, id_rows, lengths_dtype, world_size)

    def _pack(
        self,
        kjt: KeyedJaggedTensor,
        selected: Selected,
        id_rows: Sequence[int | None],
        lengths_dtype: torch.dtype,
        world_size: int,
    ) -> Outgoing:
        """The tensors to send: with other ranks, per destination its lengths (as
        `lengths_dtype`) and its keys' ids in one buffer, weights per key in another."""
        strides, counts, bounds = selected.strides, selected.counts, self._bounds
        values, weights = kjt.values(), kjt.weights_or_none()
        id_dtypes = [id_wire_dtype(rows, values.dtype) for rows in id_rows]
        me = self._rank
        per_rank = [range(bounds[r], bounds[r + 1]) for r in range(len(self._splits))]
        sent = Outgoing(
            keys=selected.keys[bounds[me] : bounds[me + 1]],
            input_splits={
                "lengths": [sum(strides[k] for k in keys) for keys in per_rank],
                "values": [sum(counts[k] for k in keys) for keys in per_rank],
            },
            lengths=selected.lengths,
            values=values,
            weights=weights,
            wire_splits={},
            local_id_dtypes=id_dtypes[bounds[me] : bounds[me + 1]],
            dtypes={"lengths": kjt.lengths().dtype, "values": values.dtype},
        )
        if weights is not None:
            sent.input_splits["weights"] = sent.input_splits["values"]
            sent.dtypes["weights"] = weights.dtype
        if world_size == 1:  # KJTAllToAll.forward permuted it already
            return sent
        segments: List[Segment] = []
        lengths_start = 0
        for keys, num_lengths in zip(per_rank, sent.input_splits["lengths"]):
            segments.append(Segment(selected.lengths, lengths_start, num_lengths, lengths_dtype))
            segments += [Segment(values, selected.starts[k], counts[k], id_dtypes[k]) for k in keys]
            lengths_start += num_lengths
        sent.values = pack_segments(segments, "kjt_all_to_all_values_packed")
        sent.wire_splits["values"] = [
            segment_bytes(num_lengths, lengths_dtype)
            + sum(segment_bytes(counts[k], id_dtypes[k]) for k in keys)
            for keys, num_lengths in zip(per_rank, sent.input_splits["lengths"])
        ]
        if weights is not None:
            weight_dtypes = [weights.dtype] * len(counts)
            sent.weights = pack(
                weights, counts, weight_dtypes, "kjt_all_to_all_weights_packed", selected.starts
            )
            sent.wire_splits["weights"] = [
                sum(segment_bytes(counts[k], weights.dtype) for k in keys) for keys in per_rank
            ]
        return sent

    def _wait_impl(self) -> KJTAllToAllTensorsAwaitable:
        wait_work(self._work, "kjt_all_to_all_splits", pg=self._pg)
        received = self._received.cpu()
        raise_rejected(self._input_error, received[:, REJECTED].tolist(), received[:, -MSG_WORDS:])
        check_dtypes_agree(received)
        sent = self._outgoing
        assert sent is not None  # a rejected input raised above
        return KJTAllToAllTensorsAwaitable(self._pg, received, sent, self._stagger)


class KJTAllToAll(HoldsGroup, nn.Module):
    """Send keys `[sum(splits[:r]), sum(splits[:r+1]))` of every rank's KJT to rank r.

    `splits[r]`: number of keys rank r owns (same list on every rank). `stagger` > 1
    interleaves source ranks in the output batch (table-row-wise sharding). Call:
    `kjt_a2a(kjt, input_error=None)` -> `Awaitable[Awaitable[KeyedJaggedTensor]]`. A rank
    whose input is bad passes `input_error` (bad keys / dtypes are detected here too):
    the first `wait()` then raises `ValueError(input_error)` on it and
    `RuntimeError("rank R rejected its input: ...")` on every other rank. `set_id_rows`
    tells it the range of each key's ids, so they travel in fewer bytes.
    """

    def __init__(self, pg: dist.ProcessGroup, splits: List[int], stagger: int = 1) -> None:
        super().__init__()
        world_size = dist.get_world_size(pg)
        if len(splits) != world_size:
            raise ValueError(
                f"KJTAllToAll: splits {splits} need one entry per rank (world size {world_size})"
            )
        if any(s < 0 for s in splits):
            raise ValueError(f"KJTAllToAll: splits {splits} must be non-negative")
        if stagger < 1 or world_size % stagger:
            raise ValueError(f"KJTAllToAll: stagger {stagger} must divide world size {world_size}")
        self.pg, self._splits, self._stagger = pg, list(splits), stagger
        self._id_rows: List[int | None] = [None] * sum(splits)

    def set_id_rows(self, rows_per_key: Sequence[int | None]) -> None:
        """The ids of key k lie in `[0, rows_per_key[k])` (the caller checked them; None: any
        value), so they travel in the narrowest type that holds them (`comm/wire.py`). The
        same list on every rank; without it ids travel in their own dtype."""
        if len(rows_per_key) != sum(self._splits):
            raise ValueError(
                f"KJTAllToAll.set_id_rows: {len(rows_per_key)} keys' rows for "
                f"splits {self._splits} ({sum(self._splits)} keys)"
            )
        self._id_rows = list(rows_per_key)

    def forward(
        self,
        input: KeyedJaggedTensor,
        input_error: str | None = None,
        key_order: List[int] | None = None,
    ) -> KJTAllToAllSplitsAwaitable:
        """`key_order`: send `input.permute(key_order)` (repeats allowed), the ids read where
        they lie by the pack that narrows them instead of being permuted first."""
        with torch.no_grad():
            if key_order is not None and (
                dist.get_world_size(self.pg) == 1 or input.variable_stride_per_key()
            ):
                input, key_order = input.permute(key_order), None
            return KJTAllToAllSplitsAwaitable(
                self.pg,
                input,
                self._splits,
                self._stagger,
                input_error,
                self._id_rows,
                key_order,
            )
