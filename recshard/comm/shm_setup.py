"""Setting up the shared-memory transport of one process group: switches, private segments, and
the verified connections between the group's ranks.

Segments are anonymous (`memfd_create`): they have no name in /dev/shm or anywhere else, so no
other process can find, plant or replace them, and the kernel frees them when the last process
holding one exits, however it exits. Space is reserved up front (`posix_fallocate`): a rank that
cannot get it says so instead of dying of SIGBUS later. Each segment is mode 0600.

Each pair of ranks talks over a UNIX seqpacket socket. At set-up every rank listens on a fresh
random abstract-namespace name (gone when the listener closes, right after set-up), the names
and pids travel through the group's backend, and every connection is checked with SO_PEERCRED
(the pid the group announced for that rank, this process's uid) and a secret token before
segments are exchanged over it (`socket.send_fds`). Each rank then reads a nonce out of every
peer's segment: only a rank that really maps every peer's memory says yes, and the group uses
the transport only when every rank says yes (agreed through the backend); otherwise it falls
back to the backend on all ranks.
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import stat
import struct
import time
import warnings
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ENV = "RECSHARD_SHM_ALL_TO_ALL"
CAP_ENV = "RECSHARD_SHM_CAP_MB"
DEFAULT_CAP_BYTES = 64 << 20  # shared memory one rank may hold for one group
MIN_SEGMENT = 1 << 20  # a rank's first segment, and the smallest it shrinks to
_CONNECT_S = 10.0  # how long set-up waits for a peer's connection before giving up on it
_HELLO = struct.Struct("<q16s")  # rank, the listener's token
_NONCE_BYTES = 16


def enabled() -> bool:
    """False when `RECSHARD_SHM_ALL_TO_ALL=0` (read at a group's first all-to-all)."""
    return os.environ.get(ENV, "1").strip() != "0"


def cap_bytes() -> int:
    """`RECSHARD_SHM_CAP_MB` (MiB, may be fractional) in bytes, else `DEFAULT_CAP_BYTES`."""
    text = os.environ.get(CAP_ENV, "").strip()
    if not text:
        return DEFAULT_CAP_BYTES
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or int(value * (1 << 20)) < 4096:
        raise ValueError(f"{CAP_ENV}={text!r} must be a number of MiB of at least 1/256")
    return int(value * (1 << 20))


class Segment:
    """A shared-memory segment mapped here: `data` is its bytes (`[capacity]` uint8)."""

    def __init__(self, fd: int, capacity: int, writable: bool, keep_fd: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # every page at once: cheaper than a fault per page on first use
        self._map = mmap.mmap(fd, capacity, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)
        with warnings.catch_warnings():  # a read-only view of a peer's segment, never written
            warnings.simplefilter("ignore", UserWarning)
            self.data = torch.frombuffer(self._map, dtype=torch.uint8)
        self.capacity = capacity
        self.fd = fd if keep_fd else -1

    @classmethod
    def create(cls, capacity: int) -> Segment:
        """A new private segment of `capacity` bytes, its memory reserved (OSError if there
        is not that much)."""
        fd = os.memfd_create("recshard", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, capacity)
            os.posix_fallocate(fd, 0, capacity)
            return cls(fd, capacity, writable=True, keep_fd=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int) -> Segment:
        """Map a peer's segment received as `fd` (read-only) and close the descriptor."""
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size <= 0:
                raise OSError(f"a peer's segment is not a private regular file: {info}")
            return cls(fd, info.st_size, writable=False, keep_fd=False)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Drop this process's descriptor; the mapping goes with the last reference."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _peer_pid_uid(sock: socket.socket) -> Tuple[int, int]:
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _recv(sock: socket.socket, deadline: float) -> Tuple[bytes, List[int]]:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    data, fds, _flags, _addr = socket.recv_fds(sock, 256, 4)
    return data, fds


def _check_hello(
    sock: socket.socket, deadline: float, tokens: List[bytes], pids: List[int], me: int
) -> Tuple[int, Segment]:
    """Read a peer's hello on `sock`: (its rank, its segment), checked against what the group
    announced; OSError/ValueError when anything does not match."""
    data, fds = _recv(sock, deadline)
    try:
        rank, token = _HELLO.unpack(data)
        pid, uid = _peer_pid_uid(sock)
        if not 0 <= rank < len(pids) or rank == me or pid != pids[rank] or uid != os.getuid():
            raise ValueError(f"connection from pid {pid} uid {uid} claiming rank {rank}")
        if token != tokens[me] or len(fds) != 1:
            raise ValueError(f"rank {rank} did not prove it belongs to the group")
        segment = Segment.adopt(fds.pop())
        return rank, segment
    finally:
        for fd in fds:
            os.close(fd)


class Link:
    """This rank's set-up state for a group: listener, own segment, and what peers proved."""

    def __init__(self, world_size: int, rank: int, capacity: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.token = os.urandom(16)
        self.name = f"\0recshard-{os.urandom(16).hex()}"
        self.nonce = os.urandom(_NONCE_BYTES)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.name)
        self.listener.listen(world_size + 8)
        self.segment = Segment.create(capacity)
        self.segment.data[:_NONCE_BYTES].copy_(
            torch.frombuffer(bytearray(self.nonce), dtype=torch.uint8)
        )
        self.socks: Dict[int, socket.socket] = {}
        self.peer_segments: Dict[int, Segment] = {}

    def announce(self) -> Tuple[str, bytes, bytes]:
        return self.name, self.token, self.nonce

    def connect(self, names: List[str], tokens: List[bytes], nonces: List[bytes], pids: List[int]):
        """Connect to every peer, prove each side to the other, exchange segments and check
        every peer's nonce. Raises OSError/ValueError on any failure (the caller falls back)."""
        me, deadline = self.rank, time.monotonic() + _CONNECT_S
        for peer in range(me + 1, self.world_size):  # connect up; the backlog holds them
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(_CONNECT_S)
            sock.connect(names[peer])
            pid, uid = _peer_pid_uid(sock)
            if pid != pids[peer] or uid != os.getuid():
                sock.close()
                raise ValueError(f"rank {peer}'s listener is pid {pid} uid {uid}, not {pids[peer]}")
            hello = _HELLO.pack(me, tokens[peer])
            socket.send_fds(sock, [hello], [self.segment.fd])
            self.socks[peer] = sock
        while len(self.socks) < self.world_size - 1:  # accept down (and reject strangers)
            ready, _, _ = select.select(
                [self.listener], [], [], max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise TimeoutError(f"a peer did not connect within {_CONNECT_S:.0f} s")
            sock, _ = self.listener.accept()
            try:
                rank, segment = _check_hello(sock, deadline, tokens, pids, me)
            except (OSError, ValueError) as e:
                logger.warning("shared-memory set-up: rejected a connection: %s", e)
                sock.close()
                continue
            if rank > me or rank in self.socks:
                sock.close()
                continue
            socket.send_fds(sock, [_HELLO.pack(me, tokens[rank])], [self.segment.fd])
            self.socks[rank], self.peer_segments[rank] = sock, segment
        for peer in range(me + 1, self.world_size):
            rank, segment = _check_hello(self.socks[peer], deadline, tokens, pids, me)
            if rank != peer:
                raise ValueError(f"rank {peer}'s connection answered as rank {rank}")
            self.peer_segments[peer] = segment
        for peer, segment in self.peer_segments.items():
            if bytes(segment.data[:_NONCE_BYTES].numpy()) != nonces[peer]:
                raise ValueError(f"rank {peer}'s segment does not hold its nonce")
        for sock in self.socks.values():
            sock.setblocking(False)
        self.listener.close()

    def close(self) -> None:
        """Give everything back (the group falls back to the backend)."""
        self.listener.close()
        for sock in self.socks.values():
            sock.close()
        self.segment.close()
        self.socks.clear()
        self.peer_segments.clear()


def _node() -> int:
    """This rank's node in torchrun's layout (global rank // LOCAL_WORLD_SIZE; 0 without
    one): ranks that simulate several hosts on one machine keep their traffic across
    "hosts" off shared memory, as on real hosts."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return dist.get_rank() // int(local) if local and dist.is_initialized() else 0


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def agree(pg: dist.ProcessGroup) -> Tuple[Link, List[int], int] | None:
    """Set the transport up for `pg` on every rank, or on none: `(link, pids of the ranks, cap)`
    or None (the group then uses the backend). Collective: every rank of `pg` calls it."""
    rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
    if world_size < 2:
        return None
    link, problem, cap = None, None, 0
    try:
        cap = cap_bytes()
    except ValueError as e:
        problem = str(e)
    if enabled() and problem is None:
        try:
            link = Link(world_size, rank, min(cap, MIN_SEGMENT))
        except OSError as e:
            logger.info("shared-memory transport unavailable on rank %d: %s", rank, e)
    host = (socket.gethostname(), _boot_id(), _node())
    mine = (problem, host, link.announce() if link else None, os.getpid(), os.getuid())
    everyone: List[tuple] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=pg)
    bad = [(r, e[0]) for r, e in enumerate(everyone) if e[0]]
    if bad:
        if link:
            link.close()
        raise ValueError(f"rank {bad[0][0]}: {bad[0][1]}")
    if not all(e[2] and e[1] == host and e[1][1] and e[4] == os.getuid() for e in everyone):
        if link:
            link.close()
        return None
    pids = [e[3] for e in everyone]
    ok = True
    try:
        link.connect(
            [e[2][0] for e in everyone],
            [e[2][1] for e in everyone],
            [e[2][2] for e in everyone],
            pids,
        )
    except (OSError, ValueError) as e:
        logger.info("shared-memory transport: rank %d could not reach its peers: %s", rank, e)
        ok = False
    oks: List[bool] = [False] * world_size
    dist.all_gather_object(oks, ok, group=pg)
    if not all(oks):
        link.close()
        logger.info(
            "process group of %d ranks uses the backend: ranks %s could not set up shared memory",
            world_size,
            [r for r, o in enumerate(oks) if not o],
        )
        return None
    return link, pids, cap
