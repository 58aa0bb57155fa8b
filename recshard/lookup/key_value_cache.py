"""One key_value shard's DRAM row cache: cached rows by slot, the row <-> slot maps, CLOCK
eviction, pins, and the write-back of updated rows behind the step.

A batch's ids go through `fill` (a prefetch) or `read` (a forward: every id's slot, the
slots pinned until `release` by the batch's update). The books (`CacheArrays`) are kept by one
foreign call per batch into `csrc/row_cache.cpp` (`native_row_cache`, GIL released), or by the
same steps in torch when that library is not built; both choose the same slots and victims.
Missing rows are then read straight into their slots (`RowStore.read_into`).

Eviction is CLOCK (second chance): a row comes in with its reference bit clear, and each
later batch that reads it sets it; a hand sweeps the slots in order, clearing set bits and
taking clear ones, so a victim search costs the slots it passes (O(1) amortized per miss),
not a scan of the whole cache, and a row read once leaves before rows read again. A row a
prefetch brought in stays `fresh` until its forward: that forward is its first read, not a
second, so prefetching changes nothing in what is evicted.

Threads: `lock` guards the books (a prefetch thread's choice of slots and the step's update);
`fill_lock` serializes whole fills, reads included, so two fills never take each other's slots
mid-read. Updated victims are copied under `lock` and written by a thread behind the step (each
such thread after the one before it). A fill whose missing rows include a row still being
written waits for the writes before it reads, and a flush always does (both under `fill_lock`,
so no other fill starts a write in between): a row written back is never read from storage
before its write landed, and a fill that reads none of them (a forward after its prefetch) does
not wait. A write that failed is kept and tried again before the next fill's books and reads
and before a flush, which raise its error while it still fails (a fill then undoes its books):
its rows are neither lost nor read stale. A write-back whose thread cannot start is kept the
same way (written by the next fill), and interpreter exit waits for the write-backs in flight.
The row-wise state (mapped) is copied to its mapping under `lock` when its row leaves, before
the slot is reused.
"""

from __future__ import annotations

import _thread
import atexit
import os
import threading
from typing import Dict, List, Set, Tuple

import torch

from recshard.lookup import native_row_cache
from recshard.lookup.native_row_cache import CacheArrays
from recshard.lookup.row_store import RowStore

# write-backs behind the step in flight in any cache (their `done`): waited for at interpreter
# exit, so that none is cut off inside a torch call, which aborts the process ("terminate called
# without an active exception"), and their rows land. A forked child has none of the threads.
_IN_FLIGHT: Set[threading.Event] = set()
os.register_at_fork(after_in_child=_IN_FLIGHT.clear)


@atexit.register
def _finish_write_backs() -> None:
    """Wait for every write-back still in flight (at interpreter exit)."""
    for done in list(_IN_FLIGHT):
        done.wait()


# a write-back: the rows (sorted) and their copies per file suffix
_WriteBack = Tuple[torch.Tensor, Dict[str, torch.Tensor]]


class CacheOverflowError(ValueError):
    """A batch reads more distinct rows of a shard than its cache has free slots."""


class RowCache:
    """One shard's cached rows (a tensor per field, by slot) and their books."""

    def __init__(
        self,
        store: RowStore,
        capacity: int,
        mapped: List[str],
        buffers: Dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`mapped`: row-wise fields whose file is a shared mapping (one value a row), cached
        by slot in `states` and copied to and from the mapping, not read or written by calls.
        `buffers`: the cached fields' storage by slot (`[capacity, width]`, `[capacity]` for a
        mapped field), zeros; allocated here where not given."""
        self.store = store
        self.capacity = capacity
        given = buffers or {}
        shapes = {
            name: (capacity,) if name in mapped else (capacity, width)
            for name, width in store.identity.widths.items()
        }
        cached = {
            name: given[name] if name in given else torch.zeros(shape)
            for name, shape in shapes.items()
        }
        # fields read from and written to their files, by slot
        self.values = {name: v for name, v in cached.items() if name not in mapped}
        self.mapped = {name: store.view(name) for name in mapped}  # by table row, shared
        self.states = {name: cached[name] for name in mapped}  # the mapped fields, by slot
        self.books = CacheArrays.empty(store.identity.rows, capacity)
        self.native = native_row_cache.available()
        self.pinned: List[torch.Tensor] = []  # distinct slots of each forward in flight
        self.lock = threading.Lock()
        self.fill_lock = threading.Lock()
        self.lookups = 0  # distinct rows each forward read, summed
        self.misses = 0  # rows read from storage
        # write-backs behind the step, oldest first (set when done): each thread writes after
        # the one before it, and the rows it writes (sorted) are not cached until it is done
        self._writers: List[Tuple[threading.Event, torch.Tensor]] = []
        # write-backs that failed (rows, copies), written again before any later fill or flush
        self._failed: List[_WriteBack] = []

    @property
    def row_slot(self) -> torch.Tensor:
        return self.books.row_slot

    @property
    def slot_row(self) -> torch.Tensor:
        return self.books.slot_row

    @property
    def hand(self) -> int:
        return int(self.books.cursor[0])

    # ------------------------------------------------------------------ a batch

    def fill(self, ids: torch.Tensor) -> None:
        """Bring rows `ids` (int64, any order, repeats) into the cache (a prefetch)."""
        self._ensure(ids.contiguous(), None, False)

    def read(self, ids: torch.Tensor, pin: bool) -> torch.Tensor:
        """A forward's read of rows `ids` (int64): brought in, counted, no longer fresh; their
        slots, `[len(ids)]` int64. With `pin` the slots stay pinned until `release`."""
        id_slots = torch.empty(ids.numel(), dtype=torch.int64)
        self._ensure(ids.contiguous(), id_slots, pin)
        return id_slots

    def release(self, updated: bool) -> None:
        """The oldest forward in flight is done: unpin its slots; `updated` marks them dirty."""
        with self.lock:
            slots = self.pinned.pop(0)
            if self.native:
                native_row_cache.release(self.books, slots, updated)
            else:
                self.books.pins[slots] -= 1
                if updated:
                    self.books.dirty[slots] = True

    def _ensure(self, ids: torch.Tensor, id_slots: torch.Tensor | None, pin: bool) -> None:
        with self.fill_lock:
            self._retry_failed()  # rows whose write failed: current in no file yet
            with self.lock:
                if self.native:
                    missing, victims, pinned = self._assign_native(ids, id_slots, pin)
                else:
                    missing, victims, pinned = self._assign_torch(ids, id_slots, pin)
                if pin:
                    self.pinned.append(pinned)
                for name, by_row in self.mapped.items():  # after the victims' write-back
                    self.states[name][victims] = by_row[missing]
            try:
                self._wait_for_write_back(missing)  # before a row being written is read back
                for suffix, values in self.values.items():
                    self.store.read_into(suffix, missing, values, victims)
            except BaseException:
                with self.lock:  # the rows never came in: their slots hold nothing
                    self.books.row_slot[missing] = -1
                    self.books.slot_row[victims] = -1
                    if pin:
                        self.pinned.pop()
                        self.books.pins[pinned] -= 1
                raise

    def _overflow(self, needed: int, free: int) -> CacheOverflowError:
        return CacheOverflowError(
            f"table '{self.store.identity.table}': a batch needs {needed} rows not cached but "
            f"only {free} of the cache's {self.capacity} slots are free (the rest hold this "
            "batch's or a batch in flight's rows); raise cache_load_factor"
        )

    def _assign_native(
        self, ids: torch.Tensor, id_slots: torch.Tensor | None, pin: bool
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            done = native_row_cache.assign(self.books, ids, id_slots, pin)
        except native_row_cache.CacheOverflow as e:
            raise self._overflow(e.needed, e.free) from None
        self.misses += done.missing.numel()
        if id_slots is not None:
            self.lookups += done.distinct
        self._write_back(done.dirty_rows, done.dirty_slots, behind=True)
        return done.missing, done.victims, done.pinned

    def _assign_torch(
        self, ids: torch.Tensor, id_slots: torch.Tensor | None, pin: bool
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_assign_native`'s steps in torch (`csrc/row_cache.cpp` says what they are)."""
        books = self.books
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= books.row_slot.numel()):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"row id {bad} is outside the {books.row_slot.numel()} rows")
        unique = torch.unique(ids)
        slots = books.row_slot[unique].long()
        cached = slots[slots >= 0]
        missing = unique[slots < 0]
        filled = int(books.cursor[1])
        if missing.numel() <= self.capacity - filled:
            # slots never used yet (the cache filling up): nothing to choose or write back
            victims = torch.arange(filled, filled + missing.numel())
            books.cursor[1] = filled + missing.numel()
            books.referenced[cached[~books.fresh[cached]]] = True
        else:
            victims = self._victims(cached, missing.numel())
            books.cursor[1] = self.capacity
            updated = victims[books.dirty[victims]]
            rows, order = books.slot_row[updated].sort()
            books.dirty[updated] = False
            self._write_back(rows, updated[order], behind=True)
            old = books.slot_row[victims]
            books.row_slot[old[old >= 0]] = -1
        self.misses += missing.numel()
        books.slot_row[victims] = missing
        books.row_slot[missing] = victims.to(torch.int32)
        books.referenced[victims] = False
        books.fresh[victims] = True
        pinned = torch.empty(0, dtype=torch.int64)
        if id_slots is not None:
            self.lookups += unique.numel()
            pinned = books.row_slot[unique].long()
            books.fresh[pinned] = False
            id_slots.copy_(books.row_slot[ids])
            if pin:
                books.pins[pinned] += 1
        return missing, victims, pinned

    def _victims(self, batch_slots: torch.Tensor, count: int) -> torch.Tensor:
        """`count` slots the CLOCK hand takes, neither holding rows of this batch
        (`batch_slots`) nor pinned by a batch in flight; the bits of the slots it passes are
        cleared. Raises `CacheOverflowError`, changing nothing, when too few are free."""
        books = self.books
        keep = torch.unique(torch.cat([batch_slots, books.pins.nonzero().view(-1)]))
        free = self.capacity - keep.numel()
        if count > free:
            raise self._overflow(count, free)
        books.referenced[batch_slots[~books.fresh[batch_slots]]] = True
        protected, referenced = books.scratch.view(torch.bool), books.referenced
        protected[keep] = True
        chosen: List[torch.Tensor] = []
        need, hand = count, self.hand
        while need:  # at most two turns: the first clears every bit it passes
            window = torch.arange(hand, hand + min(self.capacity, 2 * need + 1024))
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
            hand = (hand + span) % self.capacity
        books.cursor[0] = hand
        victims = torch.cat(chosen)
        protected[keep] = False
        protected[victims] = False
        return victims

    # ------------------------------------------------------------------ write-back

    def _write_back(self, rows: torch.Tensor, slots: torch.Tensor, behind: bool) -> None:
        """Write rows `rows` (sorted, unique) held in `slots` to storage (all files; the
        mapped fields at once). `behind`: copies of the rest are written on a thread while the
        step goes on (the next fill or flush waits for it and raises its error)."""
        if slots.numel() == 0:
            return
        for name, by_row in self.mapped.items():  # a memory copy: before the slots are reused
            by_row[rows] = self.states[name][slots]
        blocks = {suffix: values.index_select(0, slots) for suffix, values in self.values.items()}
        if not behind:
            self._write(rows, blocks)
            return
        before = self._writers[-1][0] if self._writers else None
        done = threading.Event()
        self._writers.append((done, rows))
        _IN_FLIGHT.add(done)
        # `threading.Thread.start` waits until the new thread runs (~0.5 ms a step on a busy
        # 2-core machine); the low-level start returns at once, and `done` says it finished
        try:
            _thread.start_new_thread(self._write_behind, (before, done, [(rows, blocks)]))
        except RuntimeError:  # no thread to spare: kept, written by the next fill or flush
            self._failed.append((rows, blocks))
            done.set()
            _IN_FLIGHT.discard(done)

    def _write(self, rows: torch.Tensor, blocks: Dict[str, torch.Tensor]) -> None:
        for suffix, block in blocks.items():
            self.store.write(suffix, rows, block)

    def _write_behind(
        self, before: threading.Event | None, done: threading.Event, job: List[_WriteBack]
    ) -> None:
        """Write `job`'s one (rows, blocks) after `before`, then set `done`. The thread holds the
        tensors only until then (`job` emptied): freeing a tensor releases the GIL, and a
        thread that takes it back during interpreter exit is stopped inside torch, which
        aborts the process; exit waits for `done` (`_finish_write_backs`)."""
        rows, blocks = job.pop()
        try:
            if before is not None:
                before.wait()  # files see the write-backs in the order the victims left
            try:
                self._write(rows, blocks)
            except BaseException:  # noqa: BLE001 - kept: written again (or raised) by the next wait
                self._failed.append((rows, blocks))
        finally:
            del rows, blocks
            done.set()
            _IN_FLIGHT.discard(done)

    def _wait_for_write_back(self, missing: torch.Tensor | None = None) -> None:
        """Wait for the write-backs behind the step (with `missing`, rows about to be read from
        the files, only when one of those is being written), then `_retry_failed`."""
        self._writers = [(done, rows) for done, rows in self._writers if not done.is_set()]
        if self._writers and (
            missing is None or any(_shares_a_row(missing, rows) for _, rows in self._writers)
        ):
            for done, _ in self._writers:
                done.wait()
            self._writers = []
        self._retry_failed()

    def _retry_failed(self) -> None:
        """Write again the write-backs that failed; raise, keeping them, while they still fail
        (their rows are neither cached nor current in the files: no step may read them, and
        none is lost)."""
        while self._failed:
            rows, blocks = self._failed[0]
            self._write(rows, blocks)
            self._failed.pop(0)

    def flush(self) -> None:
        """Write every updated row back: storage then holds the current table."""
        with self.fill_lock:
            self._wait_for_write_back()
            with self.lock:
                slots = self.books.dirty.nonzero().view(-1)
                rows, order = self.books.slot_row[slots].sort()
                self.books.dirty[slots] = False
                self._write_back(rows, slots[order], behind=False)

    def drop_unpinned(self) -> None:
        """Write every updated row back, then forget every cached row not pinned (the caller
        may write storage behind the cache)."""
        self.flush()
        with self.lock:
            books = self.books
            drop = books.pins == 0
            dropped = books.slot_row[drop]
            books.row_slot[dropped[dropped >= 0]] = -1
            books.slot_row[drop] = -1
            books.referenced[drop] = False


def _shares_a_row(rows: torch.Tensor, sorted_rows: torch.Tensor) -> bool:
    """Whether int64 `rows` and `sorted_rows` (ascending) have a row in common: a binary search
    per row (`torch.isin` sorts both and cost ~0.5 ms a step for a batch's ids)."""
    if rows.numel() == 0 or sorted_rows.numel() == 0:
        return False
    at = torch.searchsorted(sorted_rows, rows).clamp_(max=sorted_rows.numel() - 1)
    return bool((sorted_rows[at] == rows).any())
