"""This machine's storage under random row reads: latency and IOPS at several queue depths, read
past the page cache, and what a key-value step with a given count of misses is bounded at.

Writes a file of `--gib` GiB of real data (not a reserved hole: reading one costs no I/O), then
for each read size and queue depth reads random aligned blocks for `--seconds`:

- `direct`: O_DIRECT reads (the page cache never serves them; 512 bytes is the smallest an
  O_DIRECT read can be on this device, a 256-byte row costs that or a 4 KiB page);
- `rows`: batches of `--batch` rows of `--row-bytes` read by the key-value tables' own row I/O
  (`native_row_io.move_rows`, at its `depth`) after the file's pages were written out and dropped
  (`fsync` + `POSIX_FADV_DONTNEED`, `POSIX_FADV_RANDOM`: no readahead), one row per page never
  read before: what a step's misses of cold rows cost. Its latency is the batch's time per row.

A queue depth of N for `direct` is N Python threads each with one read in flight (`os.preadv`
drops the GIL). The file is deleted afterwards. `--misses` prints the bound on a step that reads
that many cold rows (at that depth's IOPS).

    flock /tmp/recshard-timing.lock python -m benchmarks.storage_latency --gib 8 --misses 5000
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import random
import tempfile
import threading
import time
from typing import Dict, List

import torch

from recshard.lookup import native_row_io

_CHUNK = 1 << 24  # bytes per write while creating the file


def make_file(path: str, size: int) -> None:
    """`size` bytes of non-zero data at `path`, written and synced."""
    block = os.urandom(_CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        done = 0
        while done < size:
            done += os.pwrite(fd, block[: min(_CHUNK, size - done)], done)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def probe_rows(
    path: str, size: int, row_bytes: int, depth: int, batch: int, seconds: float
) -> Dict:
    """Batches of `batch` cold rows (one per page, pages never read before) read by
    `move_rows` at `depth` for `seconds`: IOPS and per-row time (us) of the batches."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    pages, per_page = size // 4096, 4096 // row_bytes
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(depth))
    buffer = torch.empty(batch, row_bytes // 4)
    per_row: List[float] = []
    began = time.perf_counter()
    done = 0
    while time.perf_counter() - began < seconds and done + batch <= pages:
        rows = (order[done : done + batch] * per_page).sort().values
        start = time.perf_counter()
        native_row_io.move_rows(False, fd, pages * per_page, rows, buffer, None, depth)
        per_row.append((time.perf_counter() - start) / batch)
        done += batch
    elapsed = time.perf_counter() - began
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    per_row.sort()
    return {
        "mode": "rows",
        "read_bytes": row_bytes,
        "depth": depth,
        "reads": done,
        "iops": round(done / elapsed),
        "p50_us": round(per_row[len(per_row) // 2] * 1e6, 1),
        "p99_us": round(per_row[len(per_row) * 99 // 100] * 1e6, 1),
        "mean_us": round(elapsed / done * 1e6, 1),
    }


def probe(path: str, size: int, read_bytes: int, depth: int, seconds: float) -> Dict:
    """O_DIRECT random reads of `read_bytes` at queue depth `depth` for `seconds`: IOPS and
    latency percentiles (us)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    blocks = size // 4096
    order = random.Random(depth * 1000 + read_bytes).sample(range(blocks), blocks)
    latencies: List[List[float]] = [[] for _ in range(depth)]
    stop = time.perf_counter() + seconds
    next_block = [0]
    lock = threading.Lock()

    def reader(k: int) -> None:
        buffer = mmap.mmap(-1, 4096)  # page aligned, as O_DIRECT needs
        view = memoryview(buffer)[:read_bytes]
        while time.perf_counter() < stop:
            with lock:
                block = order[next_block[0] % blocks]
                next_block[0] += 1
            start = time.perf_counter()
            os.preadv(fd, [view], block * 4096)
            latencies[k].append(time.perf_counter() - start)

    began = time.perf_counter()
    threads = [threading.Thread(target=reader, args=(k,)) for k in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    os.close(fd)
    every = sorted(x for per in latencies for x in per)
    return {
        "mode": "direct",
        "read_bytes": read_bytes,
        "depth": depth,
        "reads": len(every),
        "iops": round(len(every) / elapsed),
        "p50_us": round(every[len(every) // 2] * 1e6, 1),
        "p99_us": round(every[len(every) * 99 // 100] * 1e6, 1),
        "mean_us": round(sum(every) / len(every) * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--directory", default=None)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--depths", default="1,4,16,32")
    parser.add_argument("--row-bytes", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2048, help="rows a `rows` batch reads")
    parser.add_argument("--misses", type=int, default=0, help="cold rows a step reads")
    args = parser.parse_args()
    size = int(args.gib * 2**30) // 4096 * 4096
    directory = tempfile.mkdtemp(prefix="storage-latency-", dir=args.directory)
    path = os.path.join(directory, "data")
    try:
        start = time.perf_counter()
        make_file(path, size)
        print(
            json.dumps(
                {
                    "created_gib": args.gib,
                    "write_s": round(time.perf_counter() - start, 1),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"
                    ),
                    "loadavg": open("/proc/loadavg").read().split()[:3],
                }
            ),
            flush=True,
        )
        for depth in (int(d) for d in args.depths.split(",")):
            for read_bytes in (4096, 0, 512):
                if read_bytes:
                    result = probe(path, size, read_bytes, depth, args.seconds)
                else:
                    result = probe_rows(path, size, args.row_bytes, depth, args.batch, args.seconds)
                if args.misses:
                    result["step_bound_ms"] = round(args.misses / result["iops"] * 1e3, 1)
                print(json.dumps(result), flush=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(directory)


if __name__ == "__main__":
    main()
