"""`compute_kernel="key_value"` on CPU: tables on local storage behind a bounded DRAM row cache.

Each local shard's rows and fused optimizer state live in files (`RowStore`); a per-table
cache of `ceil(cache_load_factor * rows)` rows (TorchRec's `cache_load_factor`, default 0.2,
from the sharder's fused params or the plan's `CacheParams.load_factor`) holds the rows in
use, evicting by CLOCK (second chance, close to least recently used). Files go to
`ssd_storage_directory` (TorchRec's fused param, `@local_rank` filled in), or without one to a
fresh private temporary directory, as in TorchRec; `check_storage` vets a given directory
before any file is made. A step:

    prefetch(batch)  ids not cached -> slots the CLOCK hand frees (updated victims written
                     back first, in row order), rows read from storage (`RowStore`)
    forward          ids -> cache slots; the pure-torch fused lookup on the cache
    backward         the same row gradients and optimizer math as `TorchFusedKernel`
                     on the cache slots, which are marked updated

Updated rows are written back when evicted, not every step (a hot row stays in DRAM and costs
no I/O; writing every updated row through cost a write per distinct row a step). State dicts
and checkpoints read the table from a mapping of the files (`table_weights`,
`optimizer_states`), which first write every updated row back and drop the cached copies (the
caller may write there: a load). Slots looked up by a forward stay pinned until its backward,
so a prefetch of the next batch never evicts them. DRAM held per table (`dram_bytes`): the
cache (`capacity x (cols + state width) x 4` bytes), its slot maps, a row -> slot map (4 bytes
a row) and a step's transient rows; rows move through `pread`/`pwrite`, so the files' pages
stay in the page cache, outside the process.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
from typing import Dict, List

import torch

from recshard.lookup.fused_params import FusedOptimSpec, apply_row_update
from recshard.lookup.kernels import LookupKernel, TorchFusedLookup, plain_lookup, row_gradients
from recshard.lookup.row_store import (
    RowStore,
    StoreIdentity,
    check_directory,
    storage_directory,
)
from recshard.lookup.tables import LocalTable
from recshard.modules.embedding_configs import DataType
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse.conversion import jagged_by_index

DEFAULT_CACHE_LOAD_FACTOR = 0.2  # TorchRec's default for key_value tables
_INIT_CHUNK_BYTES = 1 << 20  # the init's transient buffer


class CacheOverflowError(ValueError):
    """A batch reads more distinct rows of a shard than its cache has free slots."""


def state_widths(spec: FusedOptimSpec, cols: int) -> Dict[str, int]:
    """Stored values per row of each file: the weight, then each optimizer state."""
    widths = {"weight": cols}
    for name in spec.state_names:
        widths[name] = 1 if spec.rowwise_state else cols
    return widths


def store_identity(table: LocalTable, spec: FusedOptimSpec) -> StoreIdentity:
    return StoreIdentity(
        table.name,
        table.rows,
        table.cols,
        table.row_offset,
        table.col_offset,
        state_widths(spec, table.cols),
    )


def cache_rows(table: LocalTable) -> int:
    """Rows the DRAM cache of `table`'s shard holds."""
    factor = table.fused_params.cache_load_factor or DEFAULT_CACHE_LOAD_FACTOR
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"table '{table.name}': cache_load_factor must be in (0, 1], got {factor}")
    return min(table.rows, max(1, math.ceil(factor * table.rows)))


def table_directory(table: LocalTable) -> str | None:
    """Where `table`'s files go: `ssd_storage_directory` (TorchRec's fused param; its
    `@local_rank` is `LOCAL_RANK`), None when not given."""
    raw = table.fused_params.ssd_storage_directory
    return storage_directory(raw, int(os.environ.get("LOCAL_RANK", "0"))) if raw else None


def check_storage(tables: List[LocalTable], specs: List[FusedOptimSpec]) -> None:
    """Raise if a directory given for these key_value shards cannot hold them (each
    directory checked once for all its shards)."""
    per_directory: Dict[str, List[StoreIdentity]] = {}
    for table, spec in zip(tables, specs):
        directory = table_directory(table)
        if directory is not None:
            per_directory.setdefault(directory, []).append(store_identity(table, spec))
    for directory, identities in per_directory.items():
        check_directory(directory, identities)


def mapped_states(spec: FusedOptimSpec) -> List[str]:
    """Optimizer states kept in a shared mapping of their file, by table row, not in the cache:
    a row-wise state (4 bytes a row) costs a `pread` and a `pwrite` per row moved for a tenth
    of the bytes; mapped, it costs no call and `4 rows` bytes of resident pages."""
    return list(spec.state_names) if spec.rowwise_state else []


def cached_bytes(table: LocalTable, spec: FusedOptimSpec) -> int:
    """Bytes of one cached row with its cached optimizer state."""
    widths = state_widths(spec, table.cols)
    return sum(w for name, w in widths.items() if name not in mapped_states(spec)) * 4


SLOT_BYTES = 12  # per cache slot: its row (int64), referenced, fresh, dirty, protected flags
ROW_MAP_BYTES = 4  # per row of the shard: its cache slot (int32)
STEP_ROW_COPIES = 4  # a step's transient copies of its distinct rows with their state: the
# misses read, the victims written back, the rows' gradients and the optimizer's temporaries


def dram_bytes(table: LocalTable, spec: FusedOptimSpec, step_rows: int) -> int:
    """DRAM the kernel holds for `table`'s shard: the cache once (rows with their cached state,
    slot maps), the row map, the mapped row-wise state, and a step's transient copies of its
    `step_rows` distinct rows (at most the cache's)."""
    cached = cache_rows(table)
    record = cached_bytes(table, spec)
    transient = STEP_ROW_COPIES * min(step_rows, cached) * record
    mapped = table.rows * 4 * len(mapped_states(spec))
    return cached * (record + SLOT_BYTES) + table.rows * ROW_MAP_BYTES + mapped + transient


class _RowCache:
    """One shard's cached rows: a tensor per field, the row <-> slot maps, CLOCK reference
    bits, pins.

    Eviction is CLOCK (second chance): a row comes in with its reference bit clear, and each
    later batch that reads it sets it; a hand sweeps the slots in order, clearing set bits and
    taking clear ones, so a victim search costs the slots it passes (O(1) amortized per miss),
    not a scan of the whole cache, and a row read once leaves before rows read again. A row a
    prefetch brought in stays `fresh` until its forward: that forward is its first read, not a
    second, so prefetching changes nothing in what is evicted."""

    def __init__(self, store: RowStore, capacity: int, mapped: List[str]) -> None:
        self.store = store
        self.capacity = capacity
        self.values = {  # cached fields, by slot
            name: torch.zeros(capacity, width)
            for name, width in store.identity.widths.items()
            if name not in mapped
        }
        self.mapped = {name: store.view(name) for name in mapped}  # by table row, shared
        self.row_slot = torch.full((store.identity.rows,), -1, dtype=torch.int32)
        self.slot_row = torch.full((capacity,), -1, dtype=torch.int64)
        self.referenced = torch.zeros(capacity, dtype=torch.bool)
        self.fresh = torch.zeros(capacity, dtype=torch.bool)  # brought in, no forward read it yet
        self.dirty = torch.zeros(capacity, dtype=torch.bool)  # updated since read from storage
        self.protected = torch.zeros(capacity, dtype=torch.bool)  # a victim search's scratch
        self.hand = 0  # the next slot the sweep looks at
        self.filled = 0  # slots [filled, capacity) were never used
        self.pinned: List[torch.Tensor] = []
        self.lock = threading.Lock()  # a prefetch thread and the step's update share it
        self.lookups = 0  # distinct rows each forward read, summed
        self.misses = 0  # rows read from storage
        self._writer: threading.Thread | None = None  # the last write-back, behind the step
        self._write_error: BaseException | None = None

    def ensure(self, ids: torch.Tensor) -> None:
        """Bring rows `ids` (unique, sorted) into the cache, evicting by CLOCK (victims' rows
        written back, behind the step, when updated since they came in). The slots are chosen
        under the lock; the rows are read outside it, so a prefetch's reads overlap the update
        of the batch in flight (whose pinned slots it never takes)."""
        self._wait_for_write_back()  # rows it wrote may be read again now
        with self.lock:
            slots = self.row_slot[ids].long()
            cached = slots[slots >= 0]
            self.referenced[cached[~self.fresh[cached]]] = True
            missing = ids[slots < 0]
            if missing.numel() == 0:
                return
            if missing.numel() <= self.capacity - self.filled:
                # slots never used yet (the cache filling up): nothing to choose or write back
                victims = torch.arange(self.filled, self.filled + missing.numel())
                self.filled += missing.numel()
            else:
                victims = self._victims(cached, missing.numel())
                self.filled = self.capacity
                self._write_back(victims[self.dirty[victims]], behind=True)
                old = self.slot_row[victims]
                self.row_slot[old[old >= 0]] = -1
            self.misses += missing.numel()
            self.slot_row[victims] = missing
            self.row_slot[missing] = victims.to(torch.int32)
            self.referenced[victims] = False
            self.fresh[victims] = True
        try:
            for suffix, values in self.values.items():
                self.store.read_into(suffix, missing, values, victims)
        except BaseException:
            with self.lock:  # the rows never came in: their slots hold nothing
                self.row_slot[missing] = -1
                self.slot_row[victims] = -1
            raise

    def read_by_forward(self, ids: torch.Tensor) -> None:
        """A forward reads rows `ids` (unique, cached): counted, and no longer fresh."""
        self.lookups += ids.numel()
        self.fresh[self.row_slot[ids].long()] = False

    def _victims(self, batch_slots: torch.Tensor, count: int) -> torch.Tensor:
        """`count` slots the CLOCK hand takes, neither holding rows of this batch
        (`batch_slots`) nor pinned by a batch in flight; the bits of the slots it passes are
        cleared. Raises `CacheOverflowError`, changing nothing, when too few are free."""
        keep = torch.unique(torch.cat([batch_slots, *self.pinned]))
        free = self.capacity - keep.numel()
        if count > free:
            raise CacheOverflowError(
                f"table '{self.store.identity.table}': a batch needs {count} rows "
                f"not cached but only {free} of the cache's {self.capacity} slots are "
                "free (the rest hold this batch's or a batch in flight's rows); raise "
                "cache_load_factor"
            )
        protected, referenced = self.protected, self.referenced
        protected[keep] = True
        chosen: List[torch.Tensor] = []
        need = count
        while need:  # at most two turns: the first clears every bit it passes
            window = torch.arange(self.hand, self.hand + min(self.capacity, 2 * need + 1024))
            window %= self.capacity
            open_ = ~protected[window]
            takeable = open_ & ~referenced[window]
            positions = takeable.nonzero().view(-1)[:need]
            span = int(positions[-1]) + 1 if positions.numel() == need else window.numel()
            passed = window[:span]
            referenced[passed[open_[:span]]] = False
            taken = window[positions]
            protected[taken] = True  # a later window of this search may pass it again
            chosen.append(taken)
            need -= taken.numel()
            self.hand = (self.hand + span) % self.capacity
        victims = torch.cat(chosen)
        protected[keep] = False
        protected[victims] = False
        return victims

    def _write_back(self, slots: torch.Tensor, behind: bool = False) -> None:
        """Write the rows in `slots` (unique, dirty) to storage (all files); they are clean.
        `behind`: copies of the rows are written on a thread while the step goes on (the
        next `ensure` or flush waits for it and raises its error)."""
        if slots.numel() == 0:
            return
        rows, order = self.slot_row[slots].sort()
        slots = slots[order]
        blocks = {suffix: values[slots] for suffix, values in self.values.items()}
        self.dirty[slots] = False
        if not behind:
            self._write(rows, blocks)
            return
        self._writer = threading.Thread(
            target=self._write_behind, args=(rows, blocks), name="recshard-write-back", daemon=True
        )
        self._writer.start()

    def _write(self, rows: torch.Tensor, blocks: Dict[str, torch.Tensor]) -> None:
        for suffix, block in blocks.items():
            self.store.write(suffix, rows, block)

    def _write_behind(self, rows: torch.Tensor, blocks: Dict[str, torch.Tensor]) -> None:
        try:
            self._write(rows, blocks)
        except BaseException as e:  # noqa: BLE001 - raised by the next wait
            self._write_error = e

    def _wait_for_write_back(self) -> None:
        """Wait for the write-back running behind the step; raise its error."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise error

    def flush(self) -> None:
        """Write every updated row back: storage then holds the current table."""
        self._wait_for_write_back()
        self._write_back(self.dirty.nonzero().view(-1))

    def drop_unpinned(self) -> None:
        """Write every updated row back, then forget every cached row not pinned (the caller
        may write storage behind the cache)."""
        self.flush()
        keep = torch.zeros(self.capacity, dtype=torch.bool)
        for pinned in self.pinned:
            keep[pinned] = True
        dropped = self.slot_row[~keep]
        self.row_slot[dropped[dropped >= 0]] = -1
        self.slot_row[~keep] = -1
        self.referenced[~keep] = False


class KeyValueKernel(LookupKernel):
    """The fused contract with each table on storage and a bounded DRAM cache (CPU, fp32)."""

    is_fused = True

    def __init__(
        self,
        tables: List[LocalTable],
        pooled: bool,
        spec: FusedOptimSpec,
        device: torch.device,
    ) -> None:
        super().__init__(tables, pooled)
        for t in tables:
            if device.type != "cpu" or t.config.data_type != DataType.FP32:
                raise ValueError(
                    f"table '{t.name}': compute_kernel='key_value' runs on CPU with FP32 "
                    f"tables, got device {device.type}, data type {t.config.data_type.name}"
                )
        self.spec = spec
        self.lr = spec.learning_rate
        self.caches = [
            _RowCache(
                RowStore(
                    table_directory(t) or tempfile.mkdtemp(prefix="recshard-kv-"),
                    store_identity(t, spec),
                ),
                cache_rows(t) if t.rows else 0,
                mapped_states(spec),
            )
            for t in tables
        ]
        self._init_weights()

    # ------------------------------------------------------------------ storage views

    def table_weights(self) -> List[torch.Tensor]:
        """Each shard's weight mapped from storage `[rows, cols]`; the cache forgets its rows
        (the caller may write these)."""
        for cache in self.caches:
            cache.drop_unpinned()
        return [
            c.store.view("weight").view(t.rows, t.cols) for t, c in zip(self.tables, self.caches)
        ]

    def optimizer_states(self) -> List[Dict[str, torch.Tensor]]:
        """Each shard's optimizer state mapped from storage, shaped as the in-memory kernels'."""
        out = []
        for t, cache in zip(self.tables, self.caches):
            cache.drop_unpinned()
            shape = self.spec.state_shape(t.rows, t.cols)
            out.append({n: cache.store.view(n).view(shape) for n in self.spec.state_names})
        return out

    def _init_weights(self) -> None:
        """The table's init, written in chunks (the table never sits in DRAM whole)."""
        for t, cache in zip(self.tables, self.caches):
            chunk = max(1, _INIT_CHUNK_BYTES // (4 * max(t.cols, 1)))
            for first in range(0, t.rows, chunk):
                rows = torch.empty(min(chunk, t.rows - first), t.cols)
                t.config.init_weight(rows)
                cache.store.fill("weight", first, rows)

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr

    def hit_rate(self) -> float:
        """Share of the distinct rows each forward read that did not come from storage (in
        that forward or in its batch's prefetch) so far; 1.0 before any."""
        lookups = sum(c.lookups for c in self.caches)
        misses = sum(c.misses for c in self.caches)
        return max(0.0, 1.0 - misses / lookups) if lookups else 1.0

    def reset_hit_rate(self) -> None:
        """Count `hit_rate` from here on."""
        for cache in self.caches:
            cache.lookups = cache.misses = 0

    # ------------------------------------------------------------------ the step

    def prefetch(self, features: KeyedJaggedTensor) -> Dict[int, torch.Tensor]:
        """Bring every row `features` reads into the cache (the next batch's, ahead of time);
        returns the distinct rows per table index. Raises `CacheOverflowError` (having
        changed nothing in that table's cache) when they do not fit."""
        per_table: Dict[int, List[torch.Tensor]] = {}
        for jt, t_index in zip(jagged_by_index(features), self.feature_table):
            per_table.setdefault(t_index, []).append(jt.values().long())
        unique = {t_index: torch.unique(torch.cat(ids)) for t_index, ids in per_table.items()}
        for t_index, rows in unique.items():
            cache = self.caches[t_index]
            cache.ensure(rows)
        return unique

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        for t_index, rows in self.prefetch(features).items():
            self.caches[t_index].read_by_forward(rows)
        slot_values = [
            self.caches[t_index].row_slot[jt.values().long()].long()
            for jt, t_index in zip(jagged_by_index(features), self.feature_table)
        ]
        in_slots = KeyedJaggedTensor(
            features.keys(),
            torch.cat(slot_values) if slot_values else features.values().long(),
            weights=features.weights_or_none(),
            lengths=features.lengths(),
            stride=features.stride(),
            stride_per_key_per_rank=features.stride_per_key_per_rank()
            if features.variable_stride_per_key()
            else None,
            validate=False,
        )
        if not torch.is_grad_enabled():
            return self.lookup(in_slots)
        for cache, slots in zip(self.caches, self._slots_by_table(slot_values)):
            cache.pinned.append(slots)
        placeholder = torch.empty(0, requires_grad=True)
        return TorchFusedLookup.apply(placeholder, in_slots.weights_or_none(), self, in_slots)

    def _slots_by_table(self, slot_values: List[torch.Tensor]) -> List[torch.Tensor]:
        per_table: List[List[torch.Tensor]] = [[] for _ in self.tables]
        for slots, t_index in zip(slot_values, self.feature_table):
            per_table[t_index].append(slots)
        return [torch.cat(s) if s else torch.empty(0, dtype=torch.int64) for s in per_table]

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """Features hold cache slots, not rows."""
        return plain_lookup([c.values["weight"] for c in self.caches], self, features)

    def update(
        self, features: KeyedJaggedTensor, grad_output: torch.Tensor, weights_grad: bool = False
    ) -> torch.Tensor | None:
        """`TorchFusedKernel.update` on the cache slots, which are marked updated (written back
        on eviction)."""
        cached = [c.values["weight"] for c in self.caches]
        grads, sample_grad = row_gradients(
            self, features, grad_output, cached if weights_grad else None
        )
        for t_index, cache in enumerate(self.caches):
            with cache.lock, torch.no_grad():
                if t_index in grads:
                    slots, grad = grads[t_index]
                    states = {**cache.values, **cache.mapped}
                    weight = cache.values["weight"]
                    state_rows = cache.slot_row[slots] if cache.mapped else None
                    apply_row_update(self.spec, self.lr, weight, states, slots, grad, state_rows)
                    cache.dirty[slots] = True
                if cache.pinned:
                    cache.pinned.pop(0)
        return sample_grad
