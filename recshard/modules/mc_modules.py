"""Managed collision (zero-collision hashing, ZCH): raw ids -> rows of a table of `zch_size` rows.

`MCHManagedCollisionModule` keeps, per row, the raw id that holds it and the eviction metadata
of its policy (`recshard.modules.mc_eviction`). In training, every forward counts the ids it
sees; every `eviction_interval` iterations the ids seen since the last eviction compete with
the ids holding rows and the policy's best keep or get a row. An id holding a row maps to it
until evicted; any other id maps to the reserved last row of its bucket (TorchRec's default
row). `evict()` hands the rows given to new ids since the last call to the embedding module,
which resets them.

Buckets (`recshard.modules.mc_base`): an id only ever holds a row of bucket `id % buckets`,
and each bucket evicts on its own, so a row-wise shard of whole buckets remaps like the whole
(`buckets=1`, TorchRec's default, is one table). A module may hold a slice of the buckets
(`rebuild_with_bucket_range`): its buffers cover their rows only; it returns global rows.

State (`state_dict`), indexed by local row: `_mch_raw_ids` (the id holding the row, int64 max
if free), `_mch_<metadata>` per policy; `_current_iter_tensor`; and the history, the ids seen
since the last eviction (`recshard.modules.mc_history`: entries, not rows).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch

from recshard.modules.mc_base import (
    FREE,
    HashFunc,
    ManagedCollisionModule,
    bucket_row_starts,
    with_values,
)
from recshard.modules.mc_collection import ManagedCollisionCollection
from recshard.modules.mc_compete import Contest, rank_contest
from recshard.modules.mc_entry_state import MCHEntryState
from recshard.modules.mc_eviction import (
    LAST_ACCESS,
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHEvictionPolicyMetadataInfo,
    average_threshold_filter,
    dynamic_threshold_filter,
    probabilistic_threshold_filter,
)
from recshard.modules.mc_eviction_step import MCHEvictionStep
from recshard.modules.mc_history import IDS, SEEN_AT, History
from recshard.modules.mc_index import IdIndex, LfuEvictingIndex, SortedIdIndex, check_rows
from recshard.sparse import JaggedTensor

logger = logging.getLogger(__name__)

_COUNTERS = ("admitted", "evicted")

__all__ = [
    "FREE",
    "DistanceLFU_EvictionPolicy",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "MCHEvictionPolicy",
    "MCHEvictionPolicyMetadataInfo",
    "MCHManagedCollisionModule",
    "ManagedCollisionCollection",
    "ManagedCollisionModule",
    "average_threshold_filter",
    "bucket_row_starts",
    "dynamic_threshold_filter",
    "probabilistic_threshold_filter",
]


class MCHManagedCollisionModule(MCHEntryState, MCHEvictionStep, ManagedCollisionModule):
    """ZCH with eviction (TorchRec's arguments; `buckets` as described in the module doc).

    `mch_size` / `mch_hash_func` are deprecated in TorchRec and ignored there; here too, with
    the same warning.
    """

    def __init__(
        self,
        zch_size: int,
        device: torch.device | str | None,
        eviction_policy: MCHEvictionPolicy,
        eviction_interval: int,
        input_hash_size: int = (2**63) - 1,
        input_hash_func: HashFunc | None = None,
        mch_size: int | None = None,
        mch_hash_func: HashFunc | None = None,
        name: str | None = None,
        buckets: int = 1,
        bucket_range: Tuple[int, int] | None = None,
    ) -> None:
        super().__init__(device)
        label = f"MCHManagedCollisionModule '{name}'" if name else "MCHManagedCollisionModule"
        if mch_size is not None or mch_hash_func is not None:
            logger.warning(
                "%s: mch_size / mch_hash_func are deprecated (as in TorchRec) and ignored", label
            )
        if zch_size < 1:
            raise ValueError(f"{label}: zch_size must be >= 1, got {zch_size}")
        if buckets < 1 or buckets > zch_size:
            raise ValueError(
                f"{label}: buckets must be in [1, zch_size={zch_size}] (each bucket needs a row), "
                f"got {buckets}"
            )
        if eviction_interval < 1:
            raise ValueError(f"{label}: eviction_interval must be >= 1, got {eviction_interval}")
        if not 1 <= input_hash_size <= FREE:
            raise ValueError(
                f"{label}: input_hash_size must be in [1, 2**63 - 1], got {input_hash_size}"
            )
        first, last = bucket_range if bucket_range is not None else (0, buckets)
        if not 0 <= first <= last <= buckets or (first == last and bucket_range is None):
            raise ValueError(f"{label}: bucket_range {bucket_range} is not inside [0, {buckets})")
        self._name = name
        self._label = label
        self._zch_size = zch_size
        self._buckets = buckets
        self._bucket_range = (first, last)
        self._input_hash_size = input_hash_size
        self._input_hash_func = input_hash_func
        self._eviction_policy = eviction_policy
        self._eviction_interval = eviction_interval
        starts = bucket_row_starts(zch_size, buckets)
        self._row_offset = starts[first]
        self._bucket_starts = [s - self._row_offset for s in starts[first : last + 1]]
        rows = self._bucket_starts[-1]
        dev = self.device
        self.register_buffer(
            "_mch_raw_ids", torch.full((rows,), FREE, dtype=torch.int64, device=dev)
        )
        for metadata in eviction_policy.metadata_names:
            self.register_buffer(
                f"_mch_{metadata}", torch.zeros(rows, dtype=torch.int64, device=dev)
            )
        self.register_buffer("_current_iter_tensor", torch.zeros(1, dtype=torch.int64, device=dev))
        self._history = History(
            [IDS] + ([SEEN_AT] if LAST_ACCESS in eviction_policy.metadata_names else []), dev
        )
        for name, view in self._history.views().items():
            self.register_buffer(name, view)
        self._index: IdIndex = SortedIdIndex(dev)  # derived from the state
        self._ranking: Contest = rank_contest
        # a whole LFU eviction in one call: (the index, its bucket starts)
        self._lfu_index: Tuple[LfuEvictingIndex, torch.Tensor] | None = None
        self._default_rows = self._default_rows_on(dev)
        self._evicted_rows: List[torch.Tensor] = []
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # ids remapped and, of them, ids holding a row, since the last metrics(reset=True)
        self._lookup_counts = torch.zeros(2, dtype=torch.int64, device=dev)
        self._rebuild_index()
        self.replicated = False  # see entry_state_names
        self.register_load_state_dict_post_hook(lambda module, _keys: module.validate_state())

    def _default_rows_on(self, device: torch.device) -> torch.Tensor:
        """`[buckets]` each bucket's last row, its default (global rows)."""
        rows = [self._row_offset + s - 1 for s in self._bucket_starts[1:]]
        return torch.tensor(rows, dtype=torch.int64, device=device)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's hook
        """`.to()`, `.cuda()`, `to_empty()`: the buffers move, and the state kept beside them
        follows to their device (history, default rows, lookup counts; the id index is rebuilt
        from the moved rows at its next use), as all of TorchRec's MCH state is buffers."""
        super()._apply(fn, recurse)
        device = self._mch_raw_ids.device
        if device != self._device:
            self._device = device
            self._history.reset({n: getattr(self, n) for n in self._history.names()})
            self._sync_history()
            self._default_rows = self._default_rows_on(device)
            counts = self._lookup_counts
            self._lookup_counts = (
                torch.zeros_like(counts, device=device) if counts.is_meta else counts.to(device)
            )
            self._evicted_rows = [r.to(device) for r in self._evicted_rows]
            self._index, self._ranking = SortedIdIndex(device), rank_contest
            self._lfu_index = None
            self._index_version = -1  # `_ensure_index` rebuilds it
        return self

    # -- what the module is -------------------------------------------------------------

    def output_size(self) -> int:
        return self._zch_size

    def input_size(self) -> int:
        return self._input_hash_size

    def buckets(self) -> int:
        return self._buckets

    def bucket_range(self) -> Tuple[int, int]:
        return self._bucket_range

    def row_range(self) -> Tuple[int, int]:
        """Global rows `[start, end)` this module holds."""
        return self._row_offset, self._row_offset + self._bucket_starts[-1]

    @property
    def eviction_policy(self) -> MCHEvictionPolicy:
        return self._eviction_policy

    def metadata(self) -> Dict[str, torch.Tensor]:
        return {m: getattr(self, f"_mch_{m}") for m in self._eviction_policy.metadata_names}

    def open_slots(self) -> torch.Tensor:
        free = int((self._mch_raw_ids == FREE).sum()) - len(self._default_rows)
        return torch.tensor([free], dtype=torch.int64, device=self._mch_raw_ids.device)

    def metrics(self, reset: bool = True) -> Dict[str, float]:
        """Since the last reset: `lookups` (ids remapped), `hits` (of them, ids holding a row),
        `hit_rate`, `admitted` (ids given a row), `evicted` (ids that lost theirs); and now:
        `rows_in_use`, `open_slots`. Counts this module's buckets only (a rank's, sharded)."""
        lookups, hits = self._lookup_counts.tolist()
        out: Dict[str, float] = {"lookups": lookups, "hits": hits, **self._counters}
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        out["rows_in_use"] = self.rows_in_use()
        out["open_slots"] = int(self.open_slots())
        if reset:
            self._counters = dict.fromkeys(_COUNTERS, 0)
            self._lookup_counts.zero_()
        return out

    def rows_in_use(self) -> int:
        return int(self._mch_raw_ids.numel()) - int(self.open_slots()) - len(self._default_rows)

    # -- forward ------------------------------------------------------------------------

    def preprocess(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        if self._input_hash_func is None:
            return features
        return {
            name: with_values(jt, self._input_hash_func(jt.values(), self._input_hash_size))
            for name, jt in features.items()
        }

    def check_ids(self, values: torch.Tensor, where: str) -> None:
        """Ids (after preprocessing) must lie in `[0, input_hash_size)`: ValueError otherwise."""
        if values.numel() == 0:
            return
        low, high = torch.aminmax(values)
        if int(low) < 0 or int(high) >= self._input_hash_size:
            bad = int(low) if int(low) < 0 else int(high)
            hashed = " (after input_hash_func)" if self._input_hash_func is not None else ""
            raise ValueError(
                f"{where}: id {bad}{hashed} is outside [0, input_hash_size={self._input_hash_size})"
                " of its managed collision module"
            )

    def profile(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        if self.training:
            values = [jt.values() for jt in features.values()]
            self.count(torch.cat(values) if len(values) != 1 else values[0])
        return features

    def count(self, ids: torch.Tensor) -> None:
        """One training iteration's ids `[N]` (of this module's buckets): counted, and the
        eviction run when the iteration is a multiple of `eviction_interval`."""
        if self.record(ids):
            self.run_eviction()

    def record(self, ids: torch.Tensor) -> bool:
        """`count` without the eviction: whether this iteration evicts (then `run_eviction`,
        or `lfu_eviction` and `lfu_evicted`, before the next)."""
        self._ensure_index()
        iteration = self._buffers["_current_iter_tensor"]  # not __getattr__: per module and step
        iteration.add_(1)  # type: ignore[union-attr]
        current = int(iteration)  # type: ignore[arg-type]
        self._history.append(ids.detach(), current)
        self._sync_history()
        return current % self._eviction_interval == 0

    def reserve_record(self, count: int) -> Tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`record` split for a writer of several modules' histories at once
        (`recshard.distributed.mc_native_record`): before it appends `count` ids, the state
        checked as `record` checks it and room made. Returns what it writes: the history's
        arrays (`History.arrays`) and the iteration counter `[1]` (it adds 1), then
        `recorded`."""
        self._ensure_index()
        self._history.reserve(count)
        return (*self._history.arrays(), self._buffers["_current_iter_tensor"])  # type: ignore

    def recorded(self, count: int, iteration: int) -> bool:
        """After that writer appended `count` ids seen at `iteration` (the counter's new
        value): they join the history; whether this iteration evicts (as `record`)."""
        self._history.advance(count)
        self._sync_history()
        return iteration % self._eviction_interval == 0

    def run_eviction(self) -> None:
        """The eviction of the iteration `record` counted last."""
        self._coalesce_and_evict(int(self._current_iter_tensor))

    def remap(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        return {name: with_values(jt, self.remap_ids(jt.values())) for name, jt in features.items()}

    def remap_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global row of each id `[N]` (ids of this module's buckets only)."""
        self._ensure_index()
        ids = ids.to(torch.int64)
        default = self._default_rows[self._local_bucket(ids)]
        self._lookup_counts[0] += ids.numel()
        if len(self._index) == 0:
            return default
        hit, rows = self._index.find(ids)
        self._lookup_counts[1] += hit.sum()
        return torch.where(hit, rows, default)

    def index_epoch(self) -> int:
        """A number that changes whenever the ids holding rows do (cheap: no tensor op)."""
        self._ensure_index()
        return self._index.epoch

    def sorted_index(self) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(ids holding rows, sorted; their local rows; a number that changes when they do):
        from the module's own `SortedIdIndex` (not after `use_kernels`)."""
        self._ensure_index()
        if not isinstance(self._index, SortedIdIndex):
            raise TypeError(f"{self._label}: its id index is a {type(self._index).__name__}")
        return self._index.ids, self._index.rows - self._row_offset, self._index.epoch

    def id_index(self) -> IdIndex:
        """The index of the ids holding rows (derived from the state)."""
        self._ensure_index()
        return self._index

    def use_kernels(self, index: IdIndex, ranking: Contest) -> None:
        """Search the ids holding rows with `index` (empty, rebuilt here from the state) and
        rank bucket contests with `ranking` (same results as `rank_contest`): the C++ ones of
        `recshard.distributed.mc_native` on CPU; an index that can (`LfuEvictingIndex`) also
        runs each eviction of an LFU policy without a threshold filter. A move to another
        device restores the torch ones."""
        self._index, self._ranking = index, ranking
        policy = self._eviction_policy
        lfu = type(policy) is LFU_EvictionPolicy and policy.threshold_filtering_func is None
        self._lfu_index = None
        if lfu and isinstance(index, LfuEvictingIndex):  # with its bucket starts on the host
            self._lfu_index = (index, torch.tensor(self._bucket_starts, device="cpu"))
        self._rebuild_index()

    def default_rows(self) -> torch.Tensor:
        """Local reserved row of each of this module's buckets `[buckets held]`."""
        return self._default_rows - self._row_offset

    def forward(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """`{name: JaggedTensor of raw ids}` -> the same with rows as values."""
        features = self.preprocess(features)
        for name, jt in features.items():
            self.check_ids(jt.values(), f"{self._label}, feature '{name}'")
        features = self.profile(features)
        return self.remap(features)

    @torch.no_grad()
    def evict(self) -> torch.Tensor | None:
        if not self._evicted_rows:
            return None
        # one eviction's rows are distinct and sorted (as `unique` would return them)
        if len(self._evicted_rows) == 1:
            rows = self._evicted_rows[0]
        else:
            rows = torch.cat(self._evicted_rows).unique()
        self._evicted_rows = []
        return rows

    def _rebuild_index(self) -> None:
        self._index.rebuild(self._mch_raw_ids, self._row_offset)
        self._index_version = self._mch_raw_ids._version

    def _ensure_index(self) -> None:
        """Rows written from outside (a checkpoint loaded into the buffer in place, e.g. by
        torch.distributed.checkpoint): check the new state and rebuild the index. (The buffer
        read from `_buffers`: this runs per module at every remap and count.)"""
        if self._buffers["_mch_raw_ids"]._version != self._index_version:  # type: ignore
            self.validate_state()

    # -- state --------------------------------------------------------------------------

    def _sync_history(self) -> None:
        """The registered history buffers are the history's current views (set in `_buffers`
        directly: `nn.Module.__setattr__` costs more than the append, once per step)."""
        for name, view in self._history.views().items():
            self._buffers[name] = view

    def history_length(self) -> int:
        """Ids counted since the last eviction."""
        return len(self._history)

    @torch.no_grad()
    def validate_state(self) -> None:
        check_rows(
            self._mch_raw_ids,
            self._bucket_starts,
            self._buckets,
            self._bucket_range[0],
            self._input_hash_size,
            self._label,
        )
        self._rebuild_index()
        self._load_history({n: getattr(self, n) for n in self._history.names()})

    def _like(
        self, buckets: int, bucket_range: Tuple[int, int] | None, device: torch.device | None
    ) -> MCHManagedCollisionModule:
        """A fresh module with this one's configuration and the given buckets."""
        return MCHManagedCollisionModule(
            zch_size=self._zch_size,
            device=device or self.device,
            eviction_policy=self._eviction_policy,
            eviction_interval=self._eviction_interval,
            input_hash_size=self._input_hash_size,
            input_hash_func=self._input_hash_func,
            name=self._name,
            buckets=buckets,
            bucket_range=bucket_range,
        ).train(self.training)

    def rebuild_with_bucket_range(
        self, first: int, last: int, device: torch.device | None = None
    ) -> MCHManagedCollisionModule:
        rebuilt = self._like(self._buckets, (first, last), device)
        begin, end = rebuilt.row_range()
        own = self._row_offset
        if begin < own or end > own + self._mch_raw_ids.numel():
            raise ValueError(f"{self._label}: buckets [{first}, {last}) are not held here")
        with torch.no_grad():
            rebuilt._mch_raw_ids.copy_(self._mch_raw_ids[begin - own : end - own])
            for name, buffer in rebuilt.metadata().items():
                buffer.copy_(getattr(self, f"_mch_{name}")[begin - own : end - own])
            rebuilt._current_iter_tensor.copy_(self._current_iter_tensor)
        rebuilt.validate_state()
        rebuilt._load_history(self._history.views())
        return rebuilt

    def is_fresh(self) -> bool:
        """No id holds a row and no training step has run."""
        return bool((self._mch_raw_ids == FREE).all()) and int(self._current_iter_tensor) == 0

    def rebucketed(self, buckets: int) -> MCHManagedCollisionModule:
        """The same module with `buckets` buckets (state empty: ids cannot change rows)."""
        if not self.is_fresh():
            raise ValueError(
                f"{self._label}: cannot change buckets from {self._buckets} to {buckets} once ids "
                "hold rows (their rows would change); build the module with buckets >= the "
                "world size"
            )
        return self._like(buckets, None, None)

    def extra_repr(self) -> str:
        return (
            f"zch_size={self._zch_size}, buckets={self._buckets}, "
            f"bucket_range={self._bucket_range}, "
            f"eviction_interval={self._eviction_interval}, "
            f"policy={type(self._eviction_policy).__name__}"
        )
