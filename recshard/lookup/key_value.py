"""`compute_kernel="key_value"` on CPU: tables on local storage behind a bounded DRAM row cache.

Each local shard's rows and fused optimizer state live in files (`RowStore`); a per-table
cache of `ceil(cache_load_factor * rows)` rows (TorchRec's `cache_load_factor`, default 0.2,
from the sharder's fused params or the plan's `CacheParams.load_factor`) holds the rows in
use, evicting by CLOCK (second chance, close to least recently used). Files go to
`ssd_storage_directory` (TorchRec's fused param, `@local_rank` filled in), or without one to a
fresh private temporary directory, as in TorchRec, removed with its store (when collected, or
at exit; a given directory is never removed); `check_storage` vets a given directory before
any file is made. A step:

    prefetch(batch)  ids not cached -> slots the CLOCK hand frees (updated victims written
                     back behind the step, in row order), rows read from storage
                     (`key_value_cache.RowCache`: one C++ call per table keeps its books)
    forward          the same for rows not prefetched, then ids -> cache slots (pinned);
                     the in-memory fused kernel's lookup on the cache
    backward         the in-memory fused kernel's update on the cache slots, which are
                     unpinned and marked updated

The lookup and update are `NativeFusedKernel`'s C++ calls where that kernel covers the group
(CPU, pooled, fp32, row-wise Adagrad or SGD: the in-memory kernel the library builds for such
tables, so the bytes are the same), else `TorchFusedKernel`'s torch code; every cache's slots
sit back to back in one buffer (`layout`) as that kernel's rows do, and a row-wise state is
cached by slot beside them (copied from its mapping when the row comes in and back when it
leaves).

Updated rows are written back when evicted, not every step (a hot row stays in DRAM and costs
no I/O; writing every updated row through cost a write per distinct row a step). State dicts
and checkpoints read the table from a mapping of the files (`table_weights`,
`optimizer_states`), which first write every updated row back and drop the cached copies (the
caller may write there: a load). Slots looked up by a forward stay pinned until its backward,
so a prefetch of the next batch never evicts them. DRAM held per table (`dram_bytes`): the
cache (`capacity x (cols + state width) x 4` bytes), its slot maps, a row -> slot map (4 bytes
a row), a mapped row-wise state (4 bytes a row) and a step's transient rows; rows move through
`pread`/`pwrite`, so the files' pages stay in the page cache, outside the process.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import weakref
from typing import Dict, List

import torch

from recshard.lookup import native_kernel, native_tbe
from recshard.lookup.fused_params import FusedOptimSpec, apply_row_update
from recshard.lookup.huge_pages import huge_page_zeros
from recshard.lookup.kernels import LookupKernel, TorchFusedLookup, plain_lookup, row_gradients
from recshard.lookup.key_value_cache import CacheOverflowError as CacheOverflowError
from recshard.lookup.key_value_cache import RowCache
from recshard.lookup.native_row_cache import CacheArrays
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
    """Bytes of one cached row with its optimizer state (a mapped state cached by slot too)."""
    return sum(state_widths(spec, table.cols).values()) * 4


SLOT_BYTES = CacheArrays.BYTES_PER_SLOT  # per cache slot: its row, pins, flags
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


def _store(table: LocalTable, spec: FusedOptimSpec) -> RowStore:
    """`table`'s files in its `ssd_storage_directory`, or without one in a fresh private
    temporary directory that goes with the store: removed when the store is collected or at
    exit (`weakref.finalize`), so runs without a directory leave no files behind."""
    directory = table_directory(table)
    if directory is not None:
        return RowStore(directory, store_identity(table, spec))
    directory = tempfile.mkdtemp(prefix="recshard-kv-")
    try:
        store = RowStore(directory, store_identity(table, spec))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    weakref.finalize(store, shutil.rmtree, directory, True)
    return store


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
        capacities = [cache_rows(t) if t.rows else 0 for t in tables]
        # every cache's weights back to back (and its row-wise state, if any), so that one C++
        # call looks up every feature and one updates every table, as `NativeFusedKernel` does
        self.layout = native_tbe.TableLayout.of(
            capacities, [t.cols for t in tables], self.feature_table
        )
        self.native = native_kernel.computes(tables, pooled, spec, device, sum(capacities))
        self.weights = huge_page_zeros(self.layout.floats, torch.float32)
        rowwise = mapped_states(spec)
        self.momentum = huge_page_zeros(sum(capacities), torch.float32) if rowwise else None
        self.caches = []
        row_starts, weight_starts = (
            self.layout.row_start.tolist(),
            self.layout.weight_start.tolist(),
        )
        for t, capacity, row, first in zip(tables, capacities, row_starts, weight_starts):
            weights = self.weights[first : first + capacity * t.cols].view(capacity, t.cols)
            buffers = {"weight": weights}
            if self.momentum is not None:
                buffers.update({name: self.momentum[row : row + capacity] for name in rowwise})
            self.caches.append(RowCache(_store(t, spec), capacity, rowwise, buffers))
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

    def _ids_by_table(self, features: KeyedJaggedTensor) -> Dict[int, List[torch.Tensor]]:
        """Each table's features' ids (int64), in feature order."""
        per_table: Dict[int, List[torch.Tensor]] = {}
        for jt, t_index in zip(jagged_by_index(features), self.feature_table):
            per_table.setdefault(t_index, []).append(jt.values().long())
        return per_table

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Bring every row `features` reads into the cache (the next batch's, ahead of time).
        Raises `CacheOverflowError` (having changed nothing in that table's cache) when they
        do not fit."""
        for t_index, ids in self._ids_by_table(features).items():
            self.caches[t_index].fill(torch.cat(ids) if len(ids) > 1 else ids[0])

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        training = torch.is_grad_enabled()
        per_table = self._ids_by_table(features)
        slot_parts: Dict[int, List[torch.Tensor]] = {}
        for t_index, cache in enumerate(self.caches):
            ids = per_table.get(t_index)
            if ids is None:
                if training:  # released by the update like every table's
                    cache.pinned.append(torch.empty(0, dtype=torch.int64))
                continue
            slots = cache.read(torch.cat(ids) if len(ids) > 1 else ids[0], pin=training)
            slot_parts[t_index] = list(slots.split([i.numel() for i in ids]))
        slot_values = [slot_parts[t_index].pop(0) for t_index in self.feature_table]
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
        if not training:
            return self.lookup(in_slots)
        placeholder = torch.empty(0, requires_grad=True)
        return TorchFusedLookup.apply(placeholder, in_slots.weights_or_none(), self, in_slots)

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """Features hold cache slots, not rows."""
        ids = native_kernel.native_ids(features, self.layout) if self.native else None
        if ids is not None:
            return native_kernel.native_lookup(self, self.weights, self.layout, features, ids)
        return plain_lookup([c.values["weight"] for c in self.caches], self, features)

    def update(
        self, features: KeyedJaggedTensor, grad_output: torch.Tensor, weights_grad: bool = False
    ) -> torch.Tensor | None:
        """The in-memory fused kernel's update (`NativeFusedKernel`'s C++ call where it covers
        the group, else `TorchFusedKernel`'s) on the cache slots, which are marked updated
        (written back on eviction). The update touches only this batch's pinned slots, which
        no fill reads into or evicts."""
        ids = native_kernel.native_ids(features, self.layout) if self.native else None
        if ids is not None:
            with contextlib.ExitStack() as locks:  # a flush on another thread reads whole rows
                for cache in self.caches:
                    locks.enter_context(cache.lock)
                sample_grad = native_kernel.native_update(
                    self,
                    self.weights,
                    self.momentum,
                    self.layout,
                    features,
                    ids,
                    grad_output,
                    weights_grad,
                )
            for cache in self.caches:
                if cache.pinned:
                    cache.release(updated=True)
            return sample_grad
        cached = [c.values["weight"] for c in self.caches]
        grads, sample_grad = row_gradients(
            self, features, grad_output, cached if weights_grad else None
        )
        for t_index, cache in enumerate(self.caches):
            if t_index in grads:
                with cache.lock, torch.no_grad():
                    slots, grad = grads[t_index]
                    states = {**cache.values, **cache.states}
                    apply_row_update(
                        self.spec, self.lr, cache.values["weight"], states, slots, grad
                    )
            if cache.pinned:
                cache.release(updated=t_index in grads)
        return sample_grad
