"""Rows of one table shard in files on local storage: the backing store of `key_value` tables.

Layout: one file per tensor (`<stem>.weight`, `<stem>.<optimizer state>`), fp32 rows back to
back (`[rows, width]`), plus `<stem>.json` naming the table, the shard and the widths. `stem`
is `<table>.r<row_offset>.c<col_offset>.<rows>x<cols>`: shards of one table never collide,
whatever rank or host holds them.

Files are created with O_CREAT|O_EXCL and mode 0600 and their space is reserved up front
(`posix_fallocate`), so a directory that is missing, not writable or too small fails at
creation, and a step never meets a full disk halfway through a write. A file already there is
never reused or overwritten: the error says which table and shape it holds.

Reads and writes gather and scatter rows through a shared mapping of each file (one vectorized
`index_select` / `index_copy_`, no call per row: per-row `pread`/`pwrite` from Python cost 5-8x
the step), read with `MADV_RANDOM` (a miss reads its page, no read-ahead). Once the pages read
and written since the last release exceed `mapped_bytes`, `settle` drops them from this
process (`MADV_DONTNEED`; written rows stay in the page cache, which the kernel writes back),
so resident memory stays what the caller keeps plus about `mapped_bytes` (releasing after
every step instead re-faults the hot rows' pages each step: 2x the step time). An I/O error under a
mapping is a SIGBUS, not an exception; space is reserved, so a full disk cannot cause one.
`view` maps a file for state dicts and checkpoints (pages come in on access and leave with
the mapping).
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Dict, List

import torch

_FLOAT = 4  # bytes per stored value (fp32)
_PAGE = mmap.PAGESIZE
# a read fault maps up to this many cached pages around the one asked for (Linux's default
# fault_around_bytes, 64 KiB), and MADV_RANDOM does not stop it
_FAULT_AROUND = 16


@dataclass(frozen=True)
class StoreIdentity:
    """What a shard's files hold; written next to them and checked when a name is taken."""

    table: str
    rows: int
    cols: int
    row_offset: int
    col_offset: int
    widths: Dict[str, int]  # file suffix -> values per row ("weight": cols, states ...)

    @property
    def stem(self) -> str:
        return f"{self.table}.r{self.row_offset}.c{self.col_offset}.{self.rows}x{self.cols}"

    def bytes_needed(self) -> int:
        return self.rows * sum(self.widths.values()) * _FLOAT


def storage_directory(raw: str, local_rank: int) -> str:
    """`ssd_storage_directory` with TorchRec's `@local_rank` placeholder filled in."""
    return raw.replace("@local_rank", str(local_rank))


def _describe(path: str) -> str:
    try:
        with open(path) as f:
            held = json.load(f)
        return f"table '{held['table']}' rows {held['rows']} x cols {held['cols']}"
    except (OSError, ValueError, KeyError):
        return "unknown contents"


def check_directory(directory: str, identities: List[StoreIdentity]) -> None:
    """Raise before any file is made if `directory` cannot hold these shards: missing, not a
    writable directory, too little free space, or a file of one of them already there."""
    names = ", ".join(sorted({i.table for i in identities}))
    if not os.path.isdir(directory):
        raise ValueError(
            f"key_value tables {names}: ssd_storage_directory '{directory}' is not a directory"
        )
    try:  # a real file: permission bits alone do not say (root, read-only mounts, ACLs)
        fd, probe = tempfile.mkstemp(prefix=".recshard-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"key_value tables {names}: ssd_storage_directory '{directory}' is not writable: {e}"
        ) from e
    for identity in identities:
        for suffix in [*identity.widths, "json"]:
            path = os.path.join(directory, f"{identity.stem}.{suffix}")
            if os.path.lexists(path):
                raise ValueError(
                    f"table '{identity.table}': '{path}' already exists (holding "
                    f"{_describe(os.path.join(directory, identity.stem + '.json'))}); "
                    "key_value files are never reused: give an empty directory (restore a "
                    "table with recshard.checkpoint.load)"
                )
    _check_other_shapes(directory, identities)
    needed = sum(i.bytes_needed() for i in identities)
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if needed > free:
        raise ValueError(
            f"key_value tables {names}: need {needed} bytes in '{directory}', only {free} are free"
        )


def _check_other_shapes(directory: str, identities: List[StoreIdentity]) -> None:
    """Raise if `directory` holds files of one of these tables with another shard shape (a
    previous run's, or another plan's): they would sit beside the new ones unused."""
    stems = {i.stem for i in identities}
    tables = {i.table for i in identities}
    for name in sorted(os.listdir(directory)):
        stem, _, suffix = name.rpartition(".")
        if suffix != "json" or stem in stems:
            continue
        held = _describe(os.path.join(directory, name))
        table = stem.rsplit(".", 3)[0] if stem.count(".") >= 3 else None
        if table in tables:
            raise ValueError(
                f"table '{table}': '{directory}' already holds its key_value files of another "
                f"shape ({held}, '{name}'); give an empty directory (restore a table with "
                "recshard.checkpoint.load)"
            )


class RowStore:
    """One shard's rows on storage: `read(ids)` / `write(ids, values)` per file suffix."""

    def __init__(self, directory: str, identity: StoreIdentity, mapped_bytes: int = 0) -> None:
        self.identity = identity
        self.mapped_bytes = mapped_bytes
        self.directory = directory
        self.paths = {s: os.path.join(directory, f"{identity.stem}.{s}") for s in identity.widths}
        self._fds: Dict[str, int] = {}
        self._maps: Dict[str, mmap.mmap] = {}
        self._rows: Dict[str, torch.Tensor] = {}  # [rows, width] views of the mappings
        self._touched = 0  # bytes of pages touched since the last release (an upper bound)
        try:
            for suffix, path in self.paths.items():
                self._fds[suffix] = self._create(path, identity.rows * identity.widths[suffix])
                self._map(suffix)
            meta = os.path.join(directory, f"{identity.stem}.json")
            fd = os.open(meta, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(identity), f)
        except OSError as e:
            self.close()
            raise RuntimeError(
                f"table '{identity.table}': cannot create its key_value files in '{directory}': {e}"
            ) from e

    def _create(self, path: str, values: int) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if values:
            os.posix_fallocate(fd, 0, values * _FLOAT)
        return fd

    def _map(self, suffix: str) -> None:
        rows, width = self.identity.rows, self.width(suffix)
        if rows * width == 0:
            self._rows[suffix] = torch.empty(rows, width)
            return
        mapping = mmap.mmap(self._fds[suffix], rows * width * _FLOAT, mmap.MAP_SHARED)
        mapping.madvise(mmap.MADV_RANDOM)
        self._maps[suffix] = mapping
        self._rows[suffix] = torch.frombuffer(mapping, dtype=torch.float32).view(rows, width)

    def width(self, suffix: str) -> int:
        return self.identity.widths[suffix]

    def read(self, suffix: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64) of one file as `[len(ids), width]` fp32."""
        self._count(suffix, ids, _FAULT_AROUND)
        return self._rows[suffix].index_select(0, ids)

    def write(self, suffix: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` `[len(ids), width]` to rows `ids` (unique) of one file."""
        self._count(suffix, ids, 1)
        self._rows[suffix].index_copy_(0, ids, values.detach().to(torch.float32))

    def fill(self, suffix: str, first: int, values: torch.Tensor) -> None:
        """Write consecutive rows `first ..` (init and checkpoint loads, in chunks)."""
        self._rows[suffix][first : first + values.size(0)] = values
        self.release()

    def _count(self, suffix: str, ids: torch.Tensor, around: int) -> None:
        """Add the pages rows `ids` start on (a row wider than a page: all its pages), each
        with `around` pages mapped with it."""
        row_bytes = self.width(suffix) * _FLOAT
        if row_bytes >= _PAGE:
            self._touched += ids.numel() * (row_bytes + around * _PAGE)
        else:
            self._touched += torch.unique(ids * row_bytes // _PAGE).numel() * around * _PAGE

    def settle(self) -> None:
        """`release` once the pages touched since the last one exceed `mapped_bytes`."""
        if self._touched > self.mapped_bytes:
            self.release()

    def release(self) -> None:
        """Drop the mapped pages from this process's memory (the page cache keeps them)."""
        for mapping in self._maps.values():
            mapping.madvise(mmap.MADV_DONTNEED)
        self._touched = 0

    def view(self, suffix: str) -> torch.Tensor:
        """The whole file as a flat fp32 tensor mapped from storage (shared: writes go to the
        file; pages come in on access and leave with the last reference)."""
        values = self.identity.rows * self.width(suffix)
        if values == 0:
            return torch.empty(0)
        return torch.from_file(self.paths[suffix], shared=True, size=values)

    def close(self) -> None:
        self._rows = {}
        for mapping in self._maps.values():
            try:
                mapping.close()
            except BufferError:  # a caller still holds rows read as views: closed with them
                pass
        self._maps = {}
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        self.close()
