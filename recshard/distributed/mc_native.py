"""Managed collision's per-batch work in C++ (`csrc/mc_index.cpp`, through
`recshard.distributed.mc_library`): each table's id index, a whole batch's remap over every
table in one call, the id range check and the routing of raw ids to their owners
(`csrc/mc_route.cpp`: a counting sort, not a stable argsort), an eviction's bucket contest and
a whole LFU eviction without a threshold filter of several modules in one call
(`evict_lfu_tables`). A step's history record is `recshard.distributed.mc_native_record`'s, a
reset's numbers `recshard.distributed.mc_native_draw`'s.

`NativeIdIndex` is an open-addressing hash of the ids holding a module's rows (at most half
full; an eviction erases and inserts the ids that changed instead of rebuilding); it and
`native_contest` are given to each module of a `ShardedManagedCollisionCollection` on CPU
(`MCHManagedCollisionModule.use_kernels`); `NativeFusedRemap` reads the modules' indexes
directly, so nothing is rebuilt after an eviction. Without the library (one warning), off the
CPU, or with `RECSHARD_NATIVE_MC=0` (`mc_library.enabled`), the collection keeps the modules'
sorted indexes, the torch contest and `recshard.modules.mc_fused.FusedRemap`.

Every tensor the C++ side reads or writes is checked here (int64, 1-D, contiguous, on the CPU,
its length), and the C++ side checks every index it derives before using it. A C++ call that
cannot get its scratch memory changes nothing and raises MemoryError (`mc_library.check`).
"""

from __future__ import annotations

import ctypes
import itertools
from typing import List, Sequence, Tuple

import torch

from recshard.distributed import mc_library
from recshard.modules.mc_base import FREE
from recshard.modules.mc_index import LfuEviction
from recshard.modules.mc_modules import MCHManagedCollisionModule
from recshard.sparse import KeyedJaggedTensor

_EPOCHS = itertools.count(1)  # process-wide: no two index states share an epoch


class NativeIdIndex:
    """The ids holding a module's rows and their global rows, as `recshard.modules.mc_index.
    SortedIdIndex` offers them (`rebuild`, `replace`, `find`, `epoch`, `len`), in a C++ hash
    of `2**log2 >= 2 * rows` slots: `slots [2 * 2**log2]` int64, slot s's id at `2 s` (-1
    where free) and its global row at `2 s + 1` (one cache line holds both)."""

    def __init__(self) -> None:
        self.log2 = 1
        self.slots = torch.tensor([-1, 0, -1, 0], dtype=torch.int64)
        self._held = 0
        self.epoch = next(_EPOCHS)

    def address(self) -> int:
        """The address of `slots` for the C++ side, checked to hold 2**log2 slots."""
        return mc_library.vector("index slots", self.slots, 2 << self.log2)

    def __len__(self) -> int:
        return self._held

    @torch.no_grad()
    def rebuild(self, raw_ids: torch.Tensor, row_offset: int) -> None:
        """From the id held by each local row (`raw_ids [R]`, `FREE` if none)."""
        held = (raw_ids != FREE).nonzero().squeeze(1)
        ids = raw_ids.index_select(0, held).contiguous()
        rows = (held + row_offset).contiguous()
        log2 = max(1, (2 * raw_ids.numel() - 1).bit_length())
        slots = torch.empty(2 << log2, dtype=torch.int64)
        code = mc_library.library().rs_mc_build(
            log2,
            slots.data_ptr(),
            ids.numel(),
            mc_library.vector("held ids", ids),
            mc_library.vector("held rows", rows, ids.numel()),
        )
        mc_library.check(code, "index build")
        self.log2, self.slots, self._held = log2, slots, ids.numel()
        self.epoch = next(_EPOCHS)

    @torch.no_grad()
    def replace(self, old_ids: torch.Tensor, new_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """`old_ids` (each held) leave the index; `new_ids` (none held) come in at global
        `rows`."""
        old_ids, new_ids, rows = old_ids.contiguous(), new_ids.contiguous(), rows.contiguous()
        code = mc_library.library().rs_mc_replace(
            self.log2,
            self.address(),
            self._held,
            old_ids.numel(),
            mc_library.vector("ids leaving the index", old_ids),
            new_ids.numel(),
            mc_library.vector("ids entering the index", new_ids),
            mc_library.vector("their rows", rows, new_ids.numel()),
        )
        self.epoch = next(_EPOCHS)
        mc_library.check(code, "index update")
        self._held += new_ids.numel() - old_ids.numel()

    def find(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(whether each id `[N]` holds a row, its global row where it does, 0 elsewhere)."""
        ids = ids.contiguous()
        found = torch.empty(ids.numel(), dtype=torch.bool)
        rows = torch.empty(ids.numel(), dtype=torch.int64)
        code = mc_library.library().rs_mc_find(
            self.log2,
            self.address(),
            ids.numel(),
            mc_library.vector("ids", ids),
            found.data_ptr(),
            rows.data_ptr(),
        )
        mc_library.check(code, "index find")
        return found, rows

    def evict_lfu(self, eviction: LfuEviction) -> Tuple[torch.Tensor, int]:
        """A whole LFU eviction (no threshold filter) of the module this index serves, in one
        C++ call (`evict_lfu_tables`)."""
        return evict_lfu_tables([(self, eviction)])[0]


@torch.no_grad()
def evict_lfu_tables(
    evictions: Sequence[Tuple[NativeIdIndex, LfuEviction]],
) -> List[Tuple[torch.Tensor, int]]:
    """Whole LFU evictions (no threshold filter) of several modules, each by its index, in one
    C++ call (`rs_mc_evict_lfu_tables`): per module, the ids seen since the last one
    (`ids [N]`) coalesced, the held ones' counts added to their rows' (`counts [R]`, in place),
    the others contesting their buckets' rows (local `bucket_starts [B + 1]`); the winners
    written into `raw_ids [R]`, `counts` and the index. Returns per module (global rows that
    changed hands, sorted; how many of them had been held). Every module's arguments and ids
    are checked, and all scratch allocated, before the first is written: a refusal or
    MemoryError changes nothing (only an index found disagreeing with its rows fails midway)."""
    columns = []
    for index, e in evictions:
        # (ids must be contiguous already: a copy's address would outlive the copy)
        ids, rows = e.ids, e.raw_ids.numel()
        columns.append(
            (
                index.log2,
                index.address(),
                index._held,
                ids.numel(),
                mc_library.vector("ids seen", ids),
                rows,
                mc_library.vector("raw ids", e.raw_ids),
                mc_library.vector("counts", e.counts, rows),
                e.bucket_starts.numel() - 1,
                mc_library.vector("bucket starts", e.bucket_starts),
                e.buckets,
                e.first_bucket,
                e.row_offset,
            )
        )
    tables, seen = len(columns), sum(column[3] for column in columns)
    arguments, addresses = mc_library.argument_arrays(columns, 13, torch.int64)
    changed = torch.empty(seen, dtype=torch.int64)
    stats = torch.zeros(tables, 2, dtype=torch.int64)
    code = mc_library.library().rs_mc_evict_lfu_tables(
        tables,
        *addresses,
        seen,
        changed.data_ptr(),
        stats.data_ptr(),
    )
    results, at, none = [], 0, changed[:0]
    for (index, _), column, (changes, evicted) in zip(evictions, columns, stats.tolist()):
        index.epoch = next(_EPOCHS)
        index._held += changes - evicted  # zeros for a table left unwritten
        results.append((changed[at : at + changes] if changes else none, evicted))
        at += column[3]
    mc_library.check(code, "LFU eviction")
    return results


def native_contest(
    row_scores: torch.Tensor, held: torch.Tensor, new_scores: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """`recshard.modules.mc_compete.rank_contest` in C++ (the same pairs): a selection of the
    rows that can lose and a merge, no sort of the bucket."""
    slots, news = held.numel(), new_scores.numel()
    row_scores, held = row_scores.contiguous(), held.contiguous()
    new_scores = new_scores.contiguous()
    lose = torch.empty(min(slots, news), dtype=torch.int64)
    win = torch.empty(min(slots, news), dtype=torch.int64)
    pairs = ctypes.c_int64(0)
    code = mc_library.library().rs_mc_contest(
        slots,
        mc_library.vector("row scores", row_scores, slots, torch.float64),
        mc_library.vector("held ids", held),
        news,
        mc_library.vector("new ids' scores", new_scores, news, torch.float64),
        lose.data_ptr(),
        win.data_ptr(),
        ctypes.byref(pairs),
    )
    mc_library.check(code, "contest")
    return lose[: pairs.value], win[: pairs.value]


def _int64(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


class NativeFusedRemap:
    """Local rows of ids of several CPU MCH modules, each holding a `NativeIdIndex`, by
    segments of one table each (`remap`); `recshard.modules.mc_fused.FusedRemap`'s job in
    one C++ call, with no index of its own to rebuild."""

    def __init__(self, modules: Sequence[MCHManagedCollisionModule]) -> None:
        self._modules = list(modules)
        defaults = [m.default_rows() for m in self._modules]
        self._defaults = torch.cat(defaults).to(torch.int64).contiguous()
        self._default_starts = _int64(
            itertools.accumulate([0] + [d.numel() for d in defaults[:-1]])
        )
        self._held_buckets = _int64(d.numel() for d in defaults)
        self._buckets = _int64(m.buckets() for m in self._modules)
        self._first_buckets = _int64(m.bucket_range()[0] for m in self._modules)
        self._row_offsets = _int64(m.row_range()[0] for m in self._modules)
        tables = len(self._modules)
        # each module's lookup counters become a row of one tensor, counted by the C++ call
        self._counts = torch.zeros(tables, 2, dtype=torch.int64)
        for t, m in enumerate(self._modules):
            self._counts[t] = m._lookup_counts
            m._lookup_counts = self._counts[t]
        self._arrays: List[Tuple[NativeIdIndex, torch.Tensor]] = []
        self._epochs: List[int] = []
        self._slot_ptrs = self._log2s = _int64([])

    def _refresh(self) -> None:
        """The modules' index arrays, re-read when one changed (the indexes are held here, so
        the arrays stay alive while their addresses are in use; an eviction changes epochs,
        not arrays: the same arrays need no new addresses)."""
        indexes = [m.id_index() for m in self._modules]
        epochs = [getattr(index, "epoch", -1) for index in indexes]
        if epochs == self._epochs:
            return
        if len(indexes) == len(self._arrays) and all(
            index is held and index.slots is slots
            for index, (held, slots) in zip(indexes, self._arrays)
        ):
            self._epochs = epochs
            return
        for module, index in zip(self._modules, indexes):
            if not isinstance(index, NativeIdIndex):
                raise RuntimeError(
                    f"{module._label}: the native remap needs its NativeIdIndex, found "
                    f"{type(index).__name__} (was the module moved off the CPU?)"
                )
        self._slot_ptrs = _int64(index.address() for index in indexes)
        self._log2s = _int64(index.log2 for index in indexes)
        self._arrays = [(index, index.slots) for index in indexes]
        self._epochs = epochs

    def remap(
        self, ids: torch.Tensor, segment_tables: torch.Tensor, segment_lengths: torch.Tensor
    ) -> torch.Tensor:
        """Local row `[N]` of each id `[N]` (laid out in segments: `segment_lengths[s]` ids of
        module `segment_tables[s]`): its row, or its bucket's reserved row; counts lookups and
        hits per module."""
        self._refresh()
        ids = ids.contiguous()
        tables = len(self._modules)
        rows = torch.empty(ids.numel(), dtype=torch.int64)
        code = mc_library.library().rs_mc_remap(
            *mc_library.segment_arguments(ids, segment_tables, segment_lengths),
            tables,
            mc_library.vector("index addresses", self._slot_ptrs, tables),
            mc_library.vector("index sizes", self._log2s, tables),
            mc_library.vector("row offsets", self._row_offsets, tables),
            mc_library.vector("buckets", self._buckets, tables),
            mc_library.vector("first buckets", self._first_buckets, tables),
            mc_library.vector("held buckets", self._held_buckets, tables),
            mc_library.vector("default starts", self._default_starts, tables),
            self._defaults.numel(),
            mc_library.vector("default rows", self._defaults),
            rows.data_ptr(),
            self._counts.data_ptr(),
        )
        mc_library.check(code, "remap")
        return rows


def ids_in_range(
    ids: torch.Tensor,
    segment_tables: torch.Tensor,
    segment_lengths: torch.Tensor,
    hash_sizes: torch.Tensor,
) -> bool:
    """Whether every id `[N]` (in segments as `NativeFusedRemap.remap` takes them) lies in
    `[0, hash_sizes[table])`."""
    code = mc_library.library().rs_mc_check_ids(
        *mc_library.segment_arguments(ids, segment_tables, segment_lengths),
        hash_sizes.numel(),
        mc_library.vector("input hash sizes", hash_sizes),
    )
    if code == 5:
        return False
    mc_library.check(code, "id check")
    return True


def route(
    features: KeyedJaggedTensor,
    key_tables: torch.Tensor,
    buckets: torch.Tensor,
    first_owners: torch.Tensor,
    owner_of_bucket: torch.Tensor,
    world: int,
) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
    """`mc_modules.route_to_owners` with the owners found and the ids sorted by a counting
    sort in C++ (key k reads module `key_tables[k]`; an id's owner is
    `owner_of_bucket[first_owners[table] + id % buckets[table]]`)."""
    ids = features.values().contiguous()
    lengths = features.lengths().to(torch.int64).contiguous()
    keys, stride = len(features.keys()), features.stride()
    order = torch.empty(ids.numel(), dtype=torch.int64)
    sent_to = torch.empty(ids.numel(), dtype=torch.int64)
    routed_lengths = torch.empty(world * keys * stride, dtype=torch.int64)
    tables = buckets.numel()
    code = mc_library.library().rs_mc_route(
        keys,
        stride,
        mc_library.vector("lengths", lengths, keys * stride),
        ids.numel(),
        mc_library.vector("ids", ids),
        mc_library.vector("key tables", key_tables, keys),
        tables,
        mc_library.vector("buckets", buckets, tables),
        mc_library.vector("first owners", first_owners, tables),
        owner_of_bucket.numel(),
        mc_library.vector("owner of bucket", owner_of_bucket),
        world,
        order.data_ptr(),
        sent_to.data_ptr(),
        routed_lengths.data_ptr(),
    )
    mc_library.check(code, "routing")
    weights = features.weights_or_none()
    routed = KeyedJaggedTensor(
        features.keys() * world,
        ids.index_select(0, order),
        weights.index_select(0, order) if weights is not None else None,
        lengths=routed_lengths.to(features.lengths().dtype),
        stride=stride,
        validate=False,
    )
    return routed, sent_to
