"""Property tests of the C++ row I/O (`recshard.lookup.native_row_io.move_rows`) against a numpy
model of the file: drawn row widths (1 float up), rows in any order (runs of consecutive rows,
repeats for reads), slots in any order (adjacent ones joining one iovec, repeats: the last row read
into a slot wins), batches longer than IOV_MAX, reads one at a time or several in flight from a file
whose pages were dropped from the page cache (read by threads from the device). A row or slot out of
range is a ValueError naming it, with no byte of the file or the buffer moved; a file shorter than
its rows is an OSError, never zeros."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recshard.lookup import native_row_io

pytestmark = pytest.mark.skipif(not native_row_io.available(), reason="_row_io not built")
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def batches(draw: st.DrawFn) -> tuple:
    width = draw(st.sampled_from([1, 3, 4, 16, 33]))
    file_rows = draw(st.integers(1, 40))
    buffer_rows = draw(st.integers(1, 40))
    count = draw(st.integers(0, min(file_rows, buffer_rows)))
    start = draw(st.integers(0, file_rows - count))
    rows = draw(
        st.one_of(
            st.permutations(range(file_rows)).map(lambda p: p[:count]),  # scattered
            st.just(list(range(start, start + count))),  # one run
        )
    )
    slots = draw(
        st.one_of(
            st.permutations(range(buffer_rows)).map(lambda p: p[:count]),
            st.just(list(range(count))),  # adjacent slots: one iovec per run
            st.lists(st.integers(0, buffer_rows - 1), min_size=count, max_size=count),
            st.none(),
        )
    )
    return width, file_rows, buffer_rows, rows, slots


def _file(tmp_path: Path, rows: int, width: int, seed: int, cold: bool = False) -> tuple:
    """A file of `rows` random rows; `cold`: its pages written out and dropped from the page
    cache (reads of it go to the device)."""
    data = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    path = tmp_path / f"rows-{seed}-{rows}x{width}"
    data.tofile(path)
    fd = os.open(path, os.O_RDWR)
    if cold:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd, path, data


@FUZZ
@given(batch=batches(), write=st.booleans(), depth=st.sampled_from([1, 4]), cold=st.booleans())
def test_move_rows_matches_the_file_model(
    tmp_path: Path, batch: tuple, write: bool, depth: int, cold: bool
) -> None:
    width, file_rows, buffer_rows, rows, slots = batch
    fd, path, data = _file(tmp_path, file_rows, width, len(rows) * 7 + file_rows, cold)
    try:
        buffer = torch.full((buffer_rows, width), -9.0)
        if write:
            buffer = torch.randn(buffer_rows, width)
        before = buffer.clone()
        row_t = torch.tensor(rows, dtype=torch.int64)
        slot_t = None if slots is None else torch.tensor(slots, dtype=torch.int64)
        native_row_io.move_rows(write, fd, file_rows, row_t, buffer, slot_t, depth)
        at = list(range(len(rows))) if slots is None else slots
        after_file = np.fromfile(path, dtype=np.float32).reshape(file_rows, width)
        if write:
            expected = data.copy()
            for row, slot in zip(rows, at):
                expected[row] = before[slot].numpy()
            assert np.array_equal(after_file, expected)
            assert torch.equal(buffer, before)
        else:
            expected = before.clone()
            for row, slot in zip(rows, at):
                expected[slot] = torch.from_numpy(data[row])
            assert torch.equal(buffer, expected)
            assert np.array_equal(after_file, data)
    finally:
        os.close(fd)


@FUZZ
@given(batch=batches(), write=st.booleans(), data=st.data())
def test_an_index_out_of_range_moves_nothing(
    tmp_path: Path, batch: tuple, write: bool, data: st.DataObject
) -> None:
    width, file_rows, buffer_rows, rows, slots = batch
    if not rows:
        return
    position = data.draw(st.integers(0, len(rows) - 1))
    bad_row = data.draw(st.booleans()) or slots is None
    rows, slots = list(rows), None if slots is None else list(slots)
    if bad_row:
        rows[position] = data.draw(st.sampled_from([-1, file_rows, 2**62]))
    else:
        slots[position] = data.draw(st.sampled_from([-1, buffer_rows, 2**40]))
    fd, path, original = _file(tmp_path, file_rows, width, 3)
    try:
        buffer = torch.randn(buffer_rows, width)
        before = buffer.clone()
        slot_t = None if slots is None else torch.tensor(slots, dtype=torch.int64)
        what = "row ids" if bad_row else "slots"
        with pytest.raises(ValueError, match=rf"{what}: -?\d+ is outside the"):
            native_row_io.move_rows(
                write, fd, file_rows, torch.tensor(rows, dtype=torch.int64), buffer, slot_t
            )
        assert torch.equal(buffer, before)
        assert np.array_equal(np.fromfile(path, dtype=np.float32).reshape(-1, width), original)
    finally:
        os.close(fd)


def test_a_batch_longer_than_iov_max_in_scattered_slots(tmp_path: Path) -> None:
    """3000 consecutive rows into every other slot: runs cut at IOV_MAX iovecs each."""
    fd, path, data = _file(tmp_path, 3000, 2, 11)
    try:
        buffer = torch.zeros(6000, 2)
        slots = torch.arange(0, 6000, 2)
        native_row_io.move_rows(False, fd, 3000, torch.arange(3000), buffer, slots)
        assert torch.equal(buffer[slots], torch.from_numpy(data))
        assert not bool(buffer[1::2].any())
        buffer[slots] += 1
        native_row_io.move_rows(True, fd, 3000, torch.arange(3000), buffer, slots)
        assert np.array_equal(np.fromfile(path, dtype=np.float32).reshape(3000, 2), data + 1)
    finally:
        os.close(fd)


@pytest.mark.parametrize("depth", [1, 4])
def test_a_file_shorter_than_its_rows_is_an_error_not_zeros(tmp_path: Path, depth: int) -> None:
    fd, path, _ = _file(tmp_path, 10, 4, 5, cold=True)
    try:
        os.ftruncate(fd, 4 * 4 * 6 + 8)  # rows 0..5 whole, row 6 half
        buffer = torch.zeros(3, 4)
        with pytest.raises(OSError, match="short read"):
            native_row_io.move_rows(False, fd, 10, torch.tensor([5, 7, 6]), buffer, None, depth)
    finally:
        os.close(fd)
