"""Measuring the key-value tables' storage: scattered row reads and write-backs on a directory.

`measure_storage(directory)` makes a probe table of `file_bytes` (a fresh directory inside
`directory`, removed afterwards whatever happens), writes it out and drops it from the page
cache, then times random rows moved through `RowStore` (the key-value kernel's own I/O: one
`pread` / `pwrite` per row) for about `seconds`: reads from a cold file (a table larger than
memory misses the page cache too), then write-backs made durable (the `fsync` after the timed
writes counts: the device's rate, not the page cache's). The planner prices a key-value
table's misses and write-backs at `StorageCost.gbps` (`Topology.storage_bw`).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import torch

from recshard.lookup.row_store import RowStore, StoreIdentity
from recshard.planner.profile import StorageCost

ROW_VALUES = 64  # a dim-64 fp32 row: 256 bytes
_BATCH_ROWS = 1024  # rows per timed call


def measure_storage(
    directory: str, file_bytes: int = 64 << 20, seconds: float = 2.0
) -> StorageCost:
    """Read and write-back rates of random rows in `directory` (see the module docstring)."""
    if file_bytes < ROW_VALUES * 4 * _BATCH_ROWS:
        raise ValueError(
            f"storage probe: file_bytes must be at least {ROW_VALUES * 4 * _BATCH_ROWS}, "
            f"got {file_bytes}"
        )
    rows = file_bytes // (ROW_VALUES * 4)
    identity = StoreIdentity("storage-probe", rows, ROW_VALUES, 0, 0, {"weight": ROW_VALUES})
    try:
        probe_dir = tempfile.mkdtemp(prefix=".recshard-storage-probe-", dir=directory)
    except OSError as e:
        raise ValueError(f"storage probe: cannot write in '{directory}': {e}") from e
    try:
        store = RowStore(probe_dir, identity)
        try:
            chunk = 1 << 20
            for first in range(0, rows, chunk // (ROW_VALUES * 4)):
                count = min(chunk // (ROW_VALUES * 4), rows - first)
                store.fill("weight", first, torch.ones(count, ROW_VALUES))
            store.drop_cached()
            generator = torch.Generator().manual_seed(0)
            read = lambda ids: store.read("weight", ids)  # noqa: E731
            read_s, read_rows = _timed(seconds / 2, read, rows, generator)
            store.drop_cached()
            values = torch.full((_BATCH_ROWS, ROW_VALUES), 2.0)
            write = lambda ids: store.write("weight", ids, values[: ids.numel()])  # noqa: E731
            write_s, write_rows = _timed(seconds / 2, write, rows, generator)
            start = time.perf_counter()
            store.drop_cached()  # the rows written reach the device
            write_s += time.perf_counter() - start
        finally:
            store.close()
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    row_bytes = ROW_VALUES * 4
    return StorageCost(
        read_gbps=read_rows * row_bytes / read_s / 1e9,
        write_gbps=write_rows * row_bytes / write_s / 1e9,
        row_bytes=row_bytes,
        file_bytes=rows * row_bytes,
        directory=directory,
    )


def _timed(seconds: float, move, rows: int, generator: torch.Generator) -> tuple:  # noqa: ANN001
    """Call `move(ids)` on batches of distinct random rows for about `seconds` (at least once);
    (seconds taken, rows moved)."""
    taken, moved = 0.0, 0
    while moved == 0 or taken < seconds:
        ids = torch.unique(torch.randint(0, rows, (_BATCH_ROWS,), generator=generator))
        start = time.perf_counter()
        move(ids)
        taken += time.perf_counter() - start
        moved += ids.numel()
    return taken, moved
