"""The key_value row cache's books in C++ (`native_row_cache`) against its torch path, the
checks before each foreign call, and the write-behind against a read of the row it writes."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recshard.lookup import native_library, native_row_cache
from recshard.lookup.key_value_cache import CacheOverflowError, RowCache
from recshard.lookup.native_row_cache import CacheArrays
from recshard.lookup.row_store import RowStore, StoreIdentity
from tests.lookup.native_missing import take_library_away

ROWS, WIDTH, CAPACITY = 400, 3, 40

needs_native = pytest.mark.skipif(
    not native_row_cache.available(), reason="recshard.lookup._row_cache is not built"
)


def _cache(directory: str, native: bool, monkeypatch, capacity: int = CAPACITY) -> RowCache:  # noqa: ANN001
    """A cache over a table whose row r holds `r * WIDTH ...`; `native`: its books in C++."""
    store = RowStore(directory, StoreIdentity("t", ROWS, WIDTH, 0, 0, {"weight": WIDTH}))
    store.fill("weight", 0, _rows(torch.arange(ROWS)))
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(native_row_cache, "available", lambda: False)
        cache = RowCache(store, capacity, [])
    assert cache.native == native
    return cache


def _rows(ids: torch.Tensor) -> torch.Tensor:
    return (ids.unsqueeze(1) * WIDTH + torch.arange(WIDTH)).float()


def _books(cache: RowCache) -> dict:
    b = cache.books
    return {
        "row_slot": b.row_slot.clone(),
        "slot_row": b.slot_row.clone(),
        "referenced": b.referenced.clone(),
        "fresh": b.fresh.clone(),
        "dirty": b.dirty.clone(),
        "pins": b.pins.clone(),
        "cursor": b.cursor.clone(),
        "scratch": b.scratch.clone(),
    }


@needs_native
def test_native_and_torch_books_choose_the_same_slots(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A skewed stream with prefetches one batch ahead, pins, updates and overflows: both paths
    give every id the same slot and leave identical books, cached values and files."""
    for path in ("native", "torch"):
        (tmp_path / path).mkdir()
    caches = [
        _cache(str(tmp_path / "native"), True, monkeypatch),
        _cache(str(tmp_path / "torch"), False, monkeypatch),
    ]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(12, generator=g) ** 3 * ROWS).long() for _ in range(60)]
    batches[30] = torch.arange(100, 100 + CAPACITY + 1)  # more distinct rows than slots
    for step, ids in enumerate(batches):
        results = []
        for cache in caches:
            try:
                slots = cache.read(ids, pin=True)
            except CacheOverflowError as e:
                results.append(str(e))
                continue
            if step + 1 < len(batches) and step != 29:
                cache.fill(batches[step + 1])  # the next batch, while this one is pinned
            cache.values["weight"][slots] += 1.0  # the update
            cache.release(updated=True)
            results.append(slots)
        if isinstance(results[0], str):
            assert results[0] == results[1] and "raise cache_load_factor" in results[0]
        else:
            assert torch.equal(results[0], results[1]), f"step {step}"
        for name, value in _books(caches[0]).items():
            assert torch.equal(value, _books(caches[1])[name]), f"step {step}: {name}"
        assert torch.equal(caches[0].values["weight"], caches[1].values["weight"])
        assert (caches[0].misses, caches[0].lookups) == (caches[1].misses, caches[1].lookups)
    assert caches[0].misses > 2 * CAPACITY  # rows were evicted and read again
    for cache in caches:
        cache.flush()
    assert torch.equal(caches[0].store.view("weight"), caches[1].store.view("weight"))


@needs_native
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: setattr(a, "row_slot", a.row_slot[:-1].clone()), "outside the 399 rows"),
        (lambda a: setattr(a, "slot_row", a.slot_row.int()), "'slot_row'.*int64"),
        (lambda a: setattr(a, "pins", a.pins[:-1].clone()), "'pins'.*of 40"),
        (lambda a: setattr(a, "dirty", a.dirty.to(torch.uint8)), "'dirty'.*torch.bool"),
        (lambda a: setattr(a, "scratch", torch.zeros(80, dtype=torch.uint8)[::2]), "contiguous"),
        (lambda a: a.cursor.fill_(CAPACITY), "cursor"),
    ],
)
def test_native_assign_refuses_arrays_it_would_overrun(change, message: str) -> None:  # noqa: ANN001
    arrays = CacheArrays.empty(ROWS, CAPACITY)
    change(arrays)
    before = {k: v.clone() for k, v in vars(arrays).items()}
    with pytest.raises(ValueError, match=message):
        native_row_cache.assign(arrays, torch.tensor([3, ROWS - 1]), None, False)
    assert all(torch.equal(v, before[k]) for k, v in vars(arrays).items())


@needs_native
@pytest.mark.parametrize(
    "ids, id_slots, message",
    [
        (torch.tensor([1, ROWS]), None, f"{ROWS} is outside the {ROWS} rows"),
        (torch.tensor([-1, 2]), None, "-1 is outside"),
        (torch.tensor([1, 2], dtype=torch.int32), None, "'ids'.*int64"),
        (torch.tensor([1, 2, 3])[::2], None, "'ids'.*contiguous"),
        (torch.tensor([1, 2]), torch.empty(1, dtype=torch.int64), "'id_slots'.*of 2"),
        (torch.tensor([1, 2]), torch.empty(2, dtype=torch.int32), "'id_slots'.*int64"),
    ],
)
def test_native_assign_refuses_ids_and_outputs_it_would_overrun(
    ids: torch.Tensor, id_slots: torch.Tensor | None, message: str
) -> None:
    arrays = CacheArrays.empty(ROWS, CAPACITY)
    with pytest.raises(ValueError, match=message):
        native_row_cache.assign(arrays, ids, id_slots, False)
    assert bool((arrays.row_slot == -1).all()) and int(arrays.cursor[1]) == 0
    with pytest.raises(ValueError, match="outside the 40 slots"):
        native_row_cache.release(arrays, torch.tensor([CAPACITY]), True)


@pytest.mark.parametrize("native", [True, False])
def test_a_row_written_behind_is_not_read_back_before_its_write_lands(
    tmp_path,  # noqa: ANN001
    monkeypatch,  # noqa: ANN001
    native: bool,
) -> None:
    """An updated row evicted by one batch is written on the write-behind thread, here made
    slow (each write first sleeps); the next batches read that row again at once, from the
    main thread and from a prefetch thread. Both must see the updated values: read from the
    file before the write landed, they would be the stale ones."""
    if native and not native_row_cache.available():
        pytest.skip("recshard.lookup._row_cache is not built")
    cache = _cache(str(tmp_path), native, monkeypatch, capacity=2)
    write = cache.store.write

    def slow_write(suffix: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        time.sleep(0.2)
        write(suffix, ids, values)

    cache.store.write = slow_write  # type: ignore[method-assign]
    original = cache.store.read("weight", torch.tensor([5, 7]))
    for step in range(4):
        slots = cache.read(torch.tensor([5, 7]), pin=True)  # back from storage after step 0
        assert torch.equal(cache.values["weight"][slots], original + step), f"step {step}"
        cache.values["weight"][slots] += 1.0
        cache.release(updated=True)
        reader = threading.Thread(target=cache.fill, args=(torch.tensor([8, 9]),))
        reader.start()  # evicts 5 and 7 (updated): written behind, slowly
        reader.join()
        if step % 2:  # the prefetch thread reads them back while the write sleeps
            reader = threading.Thread(target=cache.fill, args=(torch.tensor([5, 7]),))
            reader.start()
            reader.join()


def test_missing_library_warns_once_and_torch_keeps_the_books(
    tmp_path,  # noqa: ANN001
    monkeypatch,  # noqa: ANN001
    caplog,  # noqa: ANN001
) -> None:
    take_library_away(monkeypatch, native_row_cache, "recshard.lookup._row_cache")
    with caplog.at_level("WARNING", logger=native_library.__name__):
        for i in range(2):
            store = RowStore(str(tmp_path), StoreIdentity(f"t{i}", ROWS, WIDTH, 0, 0, {"w": WIDTH}))
            store.fill("w", 0, _rows(torch.arange(ROWS)))
            cache = RowCache(store, CAPACITY, [])
            assert not cache.native
            ids = torch.tensor([3, 9, 3])
            assert torch.equal(cache.values["w"][cache.read(ids, pin=False)], _rows(ids))
    warnings = [r for r in caplog.records if "row cache library" in r.getMessage()]
    assert len(warnings) == 1 and "in torch instead" in warnings[0].getMessage()


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 12),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 30), max_size=10),  # a batch's ids
            st.sampled_from(["train", "eval", "prefetch"]),
        ),
        max_size=25,
    ),
)
def test_native_and_torch_books_agree_on_drawn_streams(capacity: int, steps: list) -> None:
    """Drawn batches of repeated ids over 31 rows, trained (pinned until the update), read
    without gradients or only prefetched, into caches of 1-12 slots (overflows included): the
    same slots, errors and books from both paths after every step."""
    with tempfile.TemporaryDirectory() as directory, pytest.MonkeyPatch.context() as patch:
        caches = []
        for native in (True, False):
            os.mkdir(os.path.join(directory, str(native)))
            caches.append(_cache(os.path.join(directory, str(native)), native, patch, capacity))
        for ids, kind in steps:
            ids_t = torch.tensor(ids, dtype=torch.int64)
            results = []
            for cache in caches:
                try:
                    if kind == "prefetch":
                        cache.fill(ids_t)
                        results.append(None)
                    else:
                        results.append(cache.read(ids_t, pin=kind == "train"))
                        if kind == "train":
                            cache.release(updated=True)
                except CacheOverflowError as e:
                    results.append(str(e))
            if isinstance(results[0], torch.Tensor):
                assert torch.equal(results[0], results[1])
                assert torch.equal(caches[0].values["weight"][results[0]], _rows(ids_t))
            else:
                assert results[0] == results[1]
            for name, value in _books(caches[0]).items():
                assert torch.equal(value, _books(caches[1])[name]), name
