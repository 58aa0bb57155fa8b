"""Open checkpoint files as regular files only, relative to their directory's descriptor.

A checkpoint directory is untrusted input: a shard may be a symlink to a file elsewhere, a FIFO
(a plain open for reading waits for a writer forever), or a device. Every file is opened with
`O_NOFOLLOW | O_NONBLOCK` relative to a descriptor of the directory (so the directory cannot
be swapped between reads), and `fstat` must say "regular file" before a byte is read. The
bytes that are hashed are the bytes that are parsed: small files are read once into memory,
shard files are hashed and then read through the same descriptor.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from types import TracebackType

MIB = 1 << 20
_CHUNK = MIB
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _kind(mode: int) -> str:
    kinds = [
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "directory"),
    ]
    return next((name for test, name in kinds if test(mode)), "special file")


def open_directory(path: Path, dir_fd: int | None = None, follow: bool = True) -> int:
    """A descriptor of the directory `path` (relative to `dir_fd` if given); `follow=False`
    refuses a symlink in its place."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(f"{path} is not a directory (or is a symbolic link)") from None
        raise


def open_regular(dir_fd: int, name: str, shown: Path) -> int:
    """Open `name` in the directory `dir_fd` for reading; `ValueError` naming `shown` unless it
    is a regular file (symlinks, FIFOs, devices and sockets are refused without blocking)."""
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(
                f"{shown} is a symbolic link; checkpoint files must be regular files "
                f"inside the checkpoint directory"
            ) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{shown} is a {_kind(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_small(dir_fd: int, name: str, shown: Path, limit: int) -> bytes:
    """The whole content of a regular file of at most `limit` bytes (JSON, LATEST)."""
    fd = open_regular(dir_fd, name, shown)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise ValueError(
                f"{shown} has {max(size, len(data))} bytes, more than the "
                f"{_shown_size(limit)} a checkpoint's {name} may hold"
            )
        while block := os.read(fd, limit + 1 - len(data)):  # a short first read
            data += block
            if len(data) > limit:
                raise ValueError(f"{shown} grew past {_shown_size(limit)} while being read")
        return data
    finally:
        os.close(fd)


def _shown_size(limit: int) -> str:
    return f"{limit // MIB} MiB" if limit >= MIB else f"{limit} bytes"


class ShardFile:
    """A shard file opened once: its size and SHA-256 checked against the manifest, then its
    byte ranges read through the same descriptor."""

    def __init__(self, dir_fd: int, name: str, shown: Path) -> None:
        self.name = name
        self.fd = open_regular(dir_fd, name, shown)
        status = os.fstat(self.fd)
        self._identity = (status.st_size, status.st_mtime_ns, status.st_ino)

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        os.close(self.fd)

    @property
    def size(self) -> int:
        return self._identity[0]

    def sha256(self) -> str:
        digest = hashlib.sha256()
        offset = 0
        while block := os.pread(self.fd, _CHUNK, offset):
            digest.update(block)
            offset += len(block)
        return digest.hexdigest()

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise ValueError(f"shard file {self.name} ended at byte {offset + len(data)}")
        return data

    def check_unchanged(self) -> None:
        """The file was not written to while it was being hashed and read."""
        status = os.fstat(self.fd)
        if (status.st_size, status.st_mtime_ns, status.st_ino) != self._identity:
            raise ValueError(f"shard file {self.name} changed while it was being loaded")
