"""The C++ row I/O's reads of cold rows several at a time (`native_row_io.move_rows`, `depth`)
under attack: depth 1 and 16 give the same bytes (repeated rows, repeated slots), several Python
threads read several tables at once, a path replaced while its descriptor is read, a file cut
short after its size was checked (a fill of the cache then raises naming table and file and
trusts none of its slots), no memory for the batch's bookkeeping (an OSError, never an abort of
the process) and no thread to spare (the calling thread reads every row)."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from recshard.lookup import native_row_io
from tests.lookup.test_key_value_cache import ROWS, _kernels
from tests.lookup.test_row_io_fuzz import _file
from tests.python_script import run_script

pytestmark = pytest.mark.skipif(not native_row_io.available(), reason="_row_io not built")
WIDTH = 5


def _cold(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.parametrize("repeated_slots", [False, True])
def test_depth_1_and_16_read_the_same_bytes(tmp_path: Path, repeated_slots: bool) -> None:
    """600 scattered rows of a cold file, rows repeated; slots distinct (read by threads) or
    repeated (read in batch order: the last row read into a slot wins)."""
    fd, _, data = _file(tmp_path, 2000, WIDTH, 11)
    try:
        generator = torch.Generator().manual_seed(0)
        rows = torch.randint(0, 2000, (600,), generator=generator)
        if repeated_slots:
            slots = torch.randint(0, 300, (600,), generator=generator)
        else:
            slots = torch.randperm(700, generator=generator)[:600]
        expected = np.zeros((700, WIDTH), dtype=np.float32)
        for row, slot in zip(rows.tolist(), slots.tolist()):
            expected[slot] = data[row]
        for depth in (1, 16, 1, 16):
            _cold(fd)
            buffer = torch.zeros(700, WIDTH)
            native_row_io.move_rows(False, fd, 2000, rows, buffer, slots, depth)
            assert np.array_equal(buffer.numpy(), expected), f"depth {depth}"
    finally:
        os.close(fd)


def test_threads_reading_tables_at_once(tmp_path: Path) -> None:
    """4 Python threads, a cold file each, 6 batches of 300 scattered rows at depth 16."""
    files = [_file(tmp_path, 1500, WIDTH + k, 20 + k) for k in range(4)]
    errors: list = []

    def reader(fd: int, data: np.ndarray, seed: int) -> None:
        try:
            for batch in range(6):
                _cold(fd)
                rows = torch.randperm(1500, generator=torch.Generator().manual_seed(seed + batch))
                buffer = torch.zeros(300, data.shape[1])
                native_row_io.move_rows(False, fd, 1500, rows[:300], buffer, None, 16)
                assert np.array_equal(buffer.numpy(), data[rows[:300].numpy()])
        except BaseException as e:  # noqa: BLE001 - checked on the test's thread
            errors.append(e)

    threads = [
        threading.Thread(target=reader, args=(fd, data, 100 * k))
        for k, (fd, _, data) in enumerate(files)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd, _, _ in files:
        os.close(fd)
    assert not errors, errors[0]


def test_a_path_replaced_while_read_changes_nothing_read(tmp_path: Path) -> None:
    """Another file renamed over the path again and again while batches are read by threads:
    every row read is the descriptor's file's."""
    fd, path, data = _file(tmp_path, 1500, WIDTH, 31)
    other = np.full((1500, WIDTH), 7.0, dtype=np.float32)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            other.tofile(f"{path}.new")
            os.rename(f"{path}.new", path)

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        for batch in range(8):
            _cold(fd)
            rows = torch.randperm(1500, generator=torch.Generator().manual_seed(batch))[:400]
            buffer = torch.zeros(400, WIDTH)
            native_row_io.move_rows(False, fd, 1500, rows, buffer, None, 16)
            assert np.array_equal(buffer.numpy(), data[rows.numpy()])
    finally:
        stop.set()
        swapper.join()
        os.close(fd)


@pytest.mark.parametrize("depth", [1, 16])
def test_a_file_cut_short_fails_the_fill_and_no_slot_is_trusted(
    depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weight file loses its last rows after creation (damage outside recshard): a batch
    whose rows lie partly past the new end raises naming the table and the file, its rows get no
    slot, and once the file is whole again the same batch reads the written bytes."""
    monkeypatch.setattr("recshard.lookup.row_store.READ_DEPTH", depth)
    with tempfile.TemporaryDirectory() as directory:
        _, kv = _kernels("exact_sgd", directory, cached_rows=ROWS)
        cache = kv.caches[0]
        store = cache.store
        whole = store.read("weight", torch.arange(ROWS))
        fd = store._fds["weight"]
        os.ftruncate(fd, (ROWS // 2) * store.width("weight") * 4 + 8)  # a row cut in half
        _cold(fd)
        ids = torch.arange(0, ROWS, 2)  # a run per row: read by threads at depth 16
        with pytest.raises(RuntimeError, match=f"table 't'.*{store.paths['weight']}.*short read"):
            cache.read(ids, pin=False)
        assert bool((cache.row_slot[ids] == -1).all())
        os.ftruncate(fd, ROWS * store.width("weight") * 4)
        store.write("weight", torch.arange(ROWS), whole)
        slots = cache.read(ids, pin=False)
        assert torch.equal(cache.values["weight"][slots], whole[ids])


OUT_OF_MEMORY = """
import os, resource, sys
import numpy as np, torch
from recshard.lookup import native_row_io

rows_count, depth = int(sys.argv[2]), int(sys.argv[3])
data = np.arange(rows_count, dtype=np.float32).reshape(rows_count, 1)
data.tofile(sys.argv[1])
fd = os.open(sys.argv[1], os.O_RDWR)
os.fsync(fd)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
rows = torch.randperm(rows_count)
buffer = torch.zeros(rows_count, 1)
status = open("/proc/self/status").read()
used = int(status.split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 20), resource.RLIM_INFINITY))
try:
    native_row_io.move_rows(False, fd, rows_count, rows, buffer, None, depth)
    print("read", np.array_equal(buffer.numpy(), data[rows.numpy()]))
except OSError as e:
    print("error", e.errno)
"""


@pytest.mark.parametrize("depth", [1, 16])
@pytest.mark.parametrize("rows", [1000, 1 << 20], ids=["no-thread-stack", "no-iovecs"])
def test_no_memory_is_an_error_and_no_thread_reads_in_order(
    tmp_path: Path, depth: int, rows: int
) -> None:
    """The address space held to 2 MiB past what the process uses: no helper thread's 8 MiB
    stack fits (1000 rows: the calling thread reads them all, same bytes) and a million rows'
    iovecs do not (ENOMEM, the process alive)."""
    result = run_script(OUT_OF_MEMORY, str(tmp_path / "rows"), str(rows), str(depth))
    assert result.returncode == 0, result.stderr
    expected = "read True" if rows == 1000 else "error 12"
    assert result.stdout.strip() == expected, result.stdout + result.stderr
