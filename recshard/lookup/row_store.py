"""Rows of one table shard in files on local storage: the backing store of `key_value` tables.

Layout: one file per tensor (`<stem>.weight`, `<stem>.<optimizer state>`), fp32 rows back to
back (`[rows, width]`), plus `<stem>.json` naming the table, the shard and the widths. `stem`
is `<table>.r<row_offset>.c<col_offset>.<rows>x<cols>`: shards of one table never collide,
whatever rank or host holds them.

Files are created with O_CREAT|O_EXCL and mode 0600 and their space is reserved up front
(`posix_fallocate`), so a directory that is missing, not writable or too small fails at
creation, and a step never meets a full disk halfway through a write. A file already there is
never reused or overwritten: the error says which table and shape it holds.

Reads and writes move each run of consecutive rows with one `preadv` / `pwritev` (rows of a
batch are mostly scattered: a run is usually one row), a whole batch in one call into the C++
row I/O (`native_row_io`, GIL released; os.pread/os.pwrite from Python when it is not built):
the page cache serves them and the process keeps nothing but what the caller holds. Rows the
page cache does not hold are read `READ_DEPTH` at a time (a disk serves a few reads in flight
much faster than one after another). Reads go
straight into the cache's slots. Measured against gathering and scattering through a
shared mapping of the files (`index_select` / `index_copy_`, then `MADV_DONTNEED` to stay in
budget): a read fault maps 16 cached pages around each row (Linux's fault-around; `MADV_RANDOM`
does not stop it) and the drop unmaps them again, 2-8x the time of a call per row from a Python
list (benchmarks/README.md, "Key-value tables: write-back cache"). Space is reserved at
creation, so a write cannot meet a full disk; any other failed or short read or write raises
naming the table and file. `view` maps a file for state dicts and checkpoints (pages come in on
access and leave with the mapping).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import tempfile
from dataclasses import asdict, dataclass
from typing import Dict, List, Tuple

import torch

from recshard.lookup import native_row_io

_FLOAT = 4  # bytes per stored value (fp32)
_PAGE = mmap.PAGESIZE
# reads in flight for rows the page cache does not hold (native row I/O; benchmarks/README.md,
# "Key-value tables: cold rows read in parallel")
READ_DEPTH = 16


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
    mode = os.stat(directory).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise ValueError(
            f"key_value tables {names}: ssd_storage_directory '{directory}' is writable by "
            f"every user (mode {stat.S_IMODE(mode):o}, no sticky bit): anyone could delete or "
            "replace the tables' files; give a directory only you (or your group) can write"
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
    space = os.statvfs(directory)
    free = space.f_bavail * space.f_frsize
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


def _runs(ids: torch.Tensor) -> Tuple[List[int], List[int]]:
    """(first row, length) of each run of consecutive rows in `ids` (unique, sorted)."""
    if ids.numel() == 0:
        return [], []
    breaks = torch.nonzero(ids[1:] != ids[:-1] + 1).view(-1) + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([ids.numel()])])
    return ids[starts].tolist(), (ends - starts).tolist()


class RowStore:
    """One shard's rows on storage: `read(ids)` / `write(ids, values)` per file suffix."""

    def __init__(self, directory: str, identity: StoreIdentity) -> None:
        self.identity = identity
        self.directory = directory
        self.paths = {s: os.path.join(directory, f"{identity.stem}.{s}") for s in identity.widths}
        self._fds: Dict[str, int] = {}
        made: List[str] = []  # removed again when creation fails (no half-made shard left)
        try:
            for suffix, path in self.paths.items():
                self._fds[suffix] = self._create(path, identity.rows * identity.widths[suffix])
                made.append(path)
            meta = os.path.join(directory, f"{identity.stem}.json")
            fd = os.open(meta, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            made.append(meta)
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(identity), f)
        except OSError as e:
            self.close()
            for path in made:
                os.unlink(path)
            raise RuntimeError(
                f"table '{identity.table}': cannot create its key_value files in '{directory}': {e}"
            ) from e

    def _create(self, path: str, values: int) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # no readahead: a row read brings in its own page alone (a small folio, as `fill`
            # makes)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            if values:
                os.posix_fallocate(fd, 0, values * _FLOAT)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        return fd

    def width(self, suffix: str) -> int:
        return self.identity.widths[suffix]

    def read(self, suffix: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, unique, sorted) of one file as `[len(ids), width]` fp32."""
        out = torch.empty(ids.numel(), self.width(suffix))
        self.read_into(suffix, ids, out, None)
        return out

    def read_into(
        self, suffix: str, ids: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor | None
    ) -> None:
        """Read rows `ids` (int64, unique, sorted) of one file into `buffer`'s rows `slots`
        (`[slots, width]` fp32; row i into slot i when None)."""
        if native_row_io.available():
            self._native(False, suffix, ids, buffer, slots, READ_DEPTH)
            return
        rows = self._pread(suffix, ids)
        if slots is None:
            buffer[: ids.numel()] = rows
        else:
            buffer[slots] = rows

    def _pread(self, suffix: str, ids: torch.Tensor) -> torch.Tensor:
        row_bytes = self.width(suffix) * _FLOAT
        fd, pread = self._fds[suffix], os.pread
        starts, lengths = _runs(ids)
        try:
            data = b"".join(
                [pread(fd, n * row_bytes, at * row_bytes) for at, n in zip(starts, lengths)]
            )
        except OSError as e:
            raise self._failed("reading", suffix, e) from e
        if len(data) != ids.numel() * row_bytes:
            raise self._failed("reading", suffix, OSError("short read"))
        return torch.frombuffer(bytearray(data), dtype=torch.float32).view(-1, self.width(suffix))

    def write(self, suffix: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` `[len(ids), width]` to rows `ids` (unique, sorted) of one file."""
        values = values.detach().to(torch.float32).contiguous()
        if native_row_io.available():
            if values.shape != (ids.numel(), self.width(suffix)):
                raise ValueError(
                    f"table '{self.identity.table}': {tuple(values.shape)} values for "
                    f"{ids.numel()} rows of width {self.width(suffix)}"
                )
            self._native(True, suffix, ids, values, None)
            return
        row_bytes = self.width(suffix) * _FLOAT
        block = memoryview(values.numpy()).cast("B")
        fd, pwrite, done = self._fds[suffix], os.pwrite, 0
        try:
            for at, n in zip(*_runs(ids)):
                size = n * row_bytes
                if pwrite(fd, block[done : done + size], at * row_bytes) != size:
                    raise OSError("short write")
                done += size
        except OSError as e:
            raise self._failed("writing", suffix, e) from e

    def _native(
        self,
        write: bool,
        suffix: str,
        ids: torch.Tensor,
        buffer: torch.Tensor,
        slots: torch.Tensor | None,
        depth: int = 1,
    ) -> None:
        if buffer.dim() != 2 or buffer.shape[1] != self.width(suffix):
            raise ValueError(
                f"table '{self.identity.table}': a row buffer of shape {tuple(buffer.shape)} "
                f"for '{self.paths[suffix]}' (rows of width {self.width(suffix)})"
            )
        try:
            native_row_io.move_rows(
                write, self._fds[suffix], self.identity.rows, ids, buffer, slots, depth
            )
        except OSError as e:
            raise self._failed("writing" if write else "reading", suffix, e) from e
        except ValueError as e:
            raise ValueError(f"table '{self.identity.table}', '{self.paths[suffix]}': {e}") from e

    def fill(self, suffix: str, first: int, values: torch.Tensor) -> None:
        """Write consecutive rows `first ..` (init and checkpoint loads, in chunks), a page
        per call: a larger write puts its pages in one large page-cache folio, and ext4 walks
        every block of a folio on each later write into it, so a 256-byte row written back
        there costs ~9 us of kernel time against ~2.5 us in a page of its own
        (benchmarks/README.md, "row I/O in C++")."""
        block = memoryview(values.detach().to(torch.float32).contiguous().numpy()).cast("B")
        at = first * self.width(suffix) * _FLOAT
        try:
            while block:
                size = min(len(block), _PAGE - at % _PAGE)
                written = os.pwrite(self._fds[suffix], block[:size], at)
                block, at = block[written:], at + written
        except OSError as e:
            raise self._failed("writing", suffix, e) from e

    def drop_cached(self) -> None:
        """Write the files out (`fsync`) and drop their pages from the page cache: the next
        reads come from the device (the storage calibration's cold reads)."""
        for fd in self._fds.values():
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _failed(self, doing: str, suffix: str, error: OSError) -> RuntimeError:
        return RuntimeError(
            f"table '{self.identity.table}': {doing} rows of '{self.paths[suffix]}' failed: {error}"
        )

    def view(self, suffix: str) -> torch.Tensor:
        """The whole file as a flat fp32 tensor mapped from storage (shared: writes go to the
        file; pages come in on access and leave with the last reference). Mapped through the
        descriptor opened at creation (`/proc/self/fd`), never the path: a file put in its
        place (a symlink to another file, a copy of another size) is not read or written."""
        values = self.identity.rows * self.width(suffix)
        if values == 0:
            return torch.empty(0)
        fd = self._fds[suffix]
        size = os.fstat(fd).st_size
        if size != values * _FLOAT:  # mapped pages past the end would fault (SIGBUS)
            raise RuntimeError(
                f"table '{self.identity.table}': '{self.paths[suffix]}' holds {size} bytes, "
                f"not the {values * _FLOAT} recshard made it with (changed outside recshard)"
            )
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=values)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        self.close()
