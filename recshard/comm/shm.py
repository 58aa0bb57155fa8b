"""All-to-all-v through private shared memory, for process groups whose ranks all run on one host.

gloo moves an all-to-all between ranks of one host over loopback TCP; the sharded step spends
about 14% of its time there (benchmarks/README.md, "shared memory"). Here each rank writes what
it sends into its own segment and every peer copies its part straight out: the same copies
gloo makes, without the sockets' buffers in between.

How. Set-up (`recshard.comm.shm_setup`) gives each pair of ranks a verified UNIX seqpacket
socket and each rank an anonymous, reserved segment of at most `cap_bytes()` (default 64 MiB)
used as a ring. A call writes each peer's part into free space of the ring (`_Ring`) and sends
that peer a small message saying where it is; the peer copies it into its output and answers
with an acknowledgement that frees the space. The messages order the memory: the kernel's
socket queue makes the payload written before a message visible to whoever reads the message
(release/acquire through the kernel, on x86-64 and aarch64 alike), and the acknowledgement
does the same for reuse. A part larger than the free space goes in pieces as space frees, so
a call of any size works with any cap. A peer's death is end-of-file on its socket: a rank
waiting for it raises a `CollectiveError` naming it at once; messages it sent before it exited
are still read first (its memory stays alive as long as a peer maps it).

Progress. Issuing never blocks: it copies what fits and returns. Whenever a rank is inside the
transport (issuing or waiting) it reads every message that arrived, copies parts of any call it
has issued (waited for or not) and writes pending pieces, oldest call first; every rank issues
a group's calls in the same order, so a waiting rank always finds its peers able to free space.
The ring grows (a new segment generation) up to the cap while calls need more, and shrinks
once the recent calls need much less.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Tuple

import torch
import torch.distributed as dist

from recshard.comm import shm_setup
from recshard.comm.errors import collective_error
from recshard.comm.pg import pg_timeout
from recshard.comm.shm_hooks import NO_HOOKS, Hooks
from recshard.comm.shm_setup import ENV, MIN_SEGMENT, Link, Segment, enabled

logger = logging.getLogger(__name__)

__all__ = ["ENV", "OP", "Exchange", "enabled", "group_for", "held_bytes", "issue"]

OP = "shm all_to_all"
_MSG = struct.Struct("<BxxxI7Q")  # kind, generation, site, call, total, at, offset, length, region
_PART, _ACK = 1, 2
_ALIGN = 64
_WINDOW = 64  # calls whose demand decides the ring's size


def _hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _PeerError(RuntimeError):
    """A peer failed or broke the protocol; `peer` is its rank."""

    def __init__(self, peer: int, text: str) -> None:
        super().__init__(text)
        self.peer = peer


class _Ring:
    """One generation of this rank's outgoing segment: regions in use, freed by acks."""

    def __init__(self, gen: int, segment: Segment) -> None:
        self.gen, self.segment, self.capacity = gen, segment, segment.capacity
        self.head = self.tail = 0  # bytes ever allocated / freed
        self.regions: Deque[List[int]] = deque()  # [end, done] in allocation order
        self.told: set = set()  # peers that have this generation's descriptor

    def empty(self) -> bool:
        return self.head == self.tail

    def alloc(self, want: int) -> Tuple[int, int, List[int]] | None:
        """(offset, bytes <= want, region) of free space, or None when the ring is full."""
        if self.empty():
            self.head = self.tail = 0
        free = self.capacity - (self.head - self.tail)
        pos = self.head % self.capacity
        contiguous = min(self.capacity - pos, free)
        if contiguous < min(want, 4096) and free > contiguous:  # a sliver before the wrap
            self.head += contiguous
            self.regions.append([self.head, 1])
            return self.alloc(want)
        if contiguous <= 0:
            return None
        n = min(want, contiguous)
        self.head += min(contiguous, -(-n // _ALIGN) * _ALIGN)
        region = [self.head, 0]
        self.regions.append(region)
        return pos, n, region

    def release(self, region: List[int]) -> None:
        region[1] = 1
        while self.regions and self.regions[0][1]:
            self.tail = self.regions.popleft()[0]


class _Write:
    """A peer's part of a call, not yet (all) in the ring."""

    __slots__ = ("exchange", "peer", "start", "done", "total")

    def __init__(self, exchange: Exchange, peer: int, start: int, total: int) -> None:
        self.exchange, self.peer, self.start, self.done, self.total = (
            exchange,
            peer,
            start,
            0,
            total,
        )


class _Group:
    """The shared-memory state of one process group on this rank."""

    def __init__(self, pg: dist.ProcessGroup, link: Link, pids: List[int], cap: int) -> None:
        self.pg, self.pids, self.cap = pg, pids, cap
        self.rank, self.world_size = link.rank, link.world_size
        self.timeout_s = pg_timeout(pg).total_seconds()
        self.socks: Dict[int, socket.socket] = dict(link.socks)
        self.peer_segments: Dict[int, Tuple[int, Segment]] = {
            p: (0, s) for p, s in link.peer_segments.items()
        }
        self.ring = _Ring(0, link.segment)
        self.ring.told = set(self.socks)
        self.old_rings: List[_Ring] = []
        self.gen = 0
        self.regions: Dict[int, Tuple[_Ring, List[int], int]] = {}  # id -> ring, region, peer
        self.next_region = 1
        self.calls = 0
        self.open: Dict[int, Exchange] = {}  # issued here, not complete
        self.stash: Dict[int, List[Tuple[int, tuple, Segment | None]]] = {}
        self.writes: Deque[_Write] = deque()
        self.outbox: Dict[int, Deque[Tuple[bytes, List[int]]]] = {p: deque() for p in self.socks}
        self.dead: Dict[int, str] = {}
        self.broken: _PeerError | None = None
        self.demand: Deque[int] = deque(maxlen=_WINDOW)
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ sending and receiving

    def _send(self, peer: int, data: bytes, fds: List[int] = ()) -> None:
        if peer not in self.dead:
            self.outbox[peer].append((data, list(fds)))
            self._flush(peer)

    def _flush(self, peer: int) -> None:
        box, sock = self.outbox[peer], self.socks[peer]
        while box and peer not in self.dead:
            data, fds = box[0]
            try:
                socket.send_fds(sock, [data], fds) if fds else sock.send(data)
            except BlockingIOError:
                return
            except OSError as e:  # broken pipe, reset: the peer is gone
                self._died(peer, f"its connection broke ({e.strerror or e})")
                return
            box.popleft()

    def _died(self, peer: int, how: str) -> None:
        if peer in self.dead:
            return
        self.dead[peer] = how
        self.outbox[peer].clear()
        for rid in [r for r, (_, _, p) in self.regions.items() if p == peer]:
            self._acked(rid)  # it will never take them

    def _receive(self, peer: int) -> None:
        sock = self.socks[peer]
        while peer not in self.dead:
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MSG.size, 1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as e:
                self._died(peer, f"its connection broke ({e.strerror or e})")
                return
            if not data and not fds:
                self._died(peer, "exited or closed its connection")
                return
            kind, gen, site, call, total, at, offset, length, region = _MSG.unpack(data)
            if fds:
                self.peer_segments[peer] = (gen, Segment.adopt(fds[0]))
            if kind == _ACK:
                self._acked(region)
                continue
            segment = None
            if length:
                have_gen, segment = self.peer_segments[peer]
                if have_gen != gen:
                    raise _PeerError(peer, f"rank {peer} wrote into segment {gen} it never sent")
            item = (peer, (site, total, at, offset, length, region), segment)
            if call in self.open:
                self._apply(self.open[call], *item)
            else:
                self.stash.setdefault(call, []).append(item)

    def _apply(self, ex: Exchange, peer: int, header: tuple, segment: Segment | None) -> None:
        """Copy a piece of `peer`'s part of `ex` into its output and acknowledge it."""
        site, total, at, offset, length, region = header
        if site != ex.site:
            raise _PeerError(
                peer,
                f"rank {peer} issued a different collective at this point (ranks must issue "
                "all-to-alls of a group in the same order)",
            )
        if total != ex.expect[peer]:
            raise _PeerError(
                peer, f"rank {peer} sends {total} bytes, this rank expects {ex.expect[peer]}"
            )
        if length:
            part = segment.data[offset : offset + length]
            if ex.hooks.place is not None and length == total:  # the whole part in one piece
                ex.hooks.place(peer, part)
            else:
                start = ex.arrive[peer] + at
                ex.out_bytes[start : start + length].copy_(part)
            self._send(peer, _MSG.pack(_ACK, 0, 0, 0, 0, 0, 0, 0, region))
        ex.got[peer] += length
        if ex.got[peer] == total:
            ex.waiting.discard(peer)
            self._maybe_done(ex)

    def _acked(self, region_id: int) -> None:
        found = self.regions.pop(region_id, None)
        if found is None:
            return
        ring, region, _ = found
        ring.release(region)
        if ring is not self.ring and ring.empty():
            self.old_rings.remove(ring)
            ring.segment.close()

    def _maybe_done(self, ex: Exchange) -> None:
        if not ex.waiting and not ex.unwritten and self.open.get(ex.call) is ex:
            del self.open[ex.call]
            ex.wire = ex.wire_bytes = None
            ex.hooks = NO_HOOKS

    # ------------------------------------------------------------------ writing

    def _write(self) -> None:
        """Put pending parts into the ring, oldest first, as far as space allows."""
        while self.writes:
            w = self.writes[0]
            ex = w.exchange
            if w.peer in self.dead:
                self.writes.popleft()
                ex.unwritten -= 1
                self._maybe_done(ex)
                continue
            if w.total == 0:
                self._send(w.peer, _MSG.pack(_PART, 0, ex.site, ex.call, 0, 0, 0, 0, 0))
            else:
                got = self.ring.alloc(w.total - w.done)
                if got is None:
                    return
                offset, n, region = got
                into = self.ring.segment.data[offset : offset + n]
                if ex.hooks.fill is not None and n == w.total:  # whole: straight into the ring
                    ex.hooks.fill(w.peer, into)
                else:
                    if ex.hooks.fill is not None and w.done == 0:
                        ex.hooks.fill(w.peer, ex.wire_bytes[w.start : w.start + w.total])
                    into.copy_(ex.wire_bytes[w.start + w.done : w.start + w.done + n])
                rid = self.next_region
                self.next_region += 1
                self.regions[rid] = (self.ring, region, w.peer)
                fds = [] if w.peer in self.ring.told else [self.ring.segment.fd]
                self.ring.told.add(w.peer)
                msg = (_PART, self.ring.gen, ex.site, ex.call, w.total, w.done, offset, n, rid)
                self._send(w.peer, _MSG.pack(*msg), fds)
                w.done += n
                if w.done < w.total:
                    continue
            self.writes.popleft()
            ex.unwritten -= 1
            self._maybe_done(ex)

    def _resize(self, need: int) -> None:
        """A new ring generation when calls need more than this one holds (twice the recent
        demand, up to the cap) or, once everything has been taken, a quarter of it or less.
        New segments cost (reserving and mapping zeroed pages), so sizes move in big steps."""
        outstanding = sum(r.head - r.tail for r in [self.ring, *self.old_rings])
        self.demand.append(outstanding + need)
        target = min(self.cap, max(MIN_SEGMENT, _pow2(2 * max(self.demand))))
        live = sum(r.capacity for r in self.old_rings)
        live += 0 if self.ring.empty() else self.ring.capacity
        grow = outstanding + need > self.ring.capacity and target > self.ring.capacity
        grow = grow and live + target <= self.cap
        shrink = 4 * target <= self.ring.capacity and outstanding == 0 and not self.writes
        if not (grow or shrink):
            return
        try:
            segment = Segment.create(target)
        except OSError as e:  # no memory for a bigger ring: keep streaming through this one
            logger.info("shared-memory ring stays at %d bytes: %s", self.ring.capacity, e)
            self.demand.clear()
            return
        if self.ring.empty():
            self.ring.segment.close()
        else:
            self.old_rings.append(self.ring)
        self.gen += 1
        self.ring = _Ring(self.gen, segment)

    # ------------------------------------------------------------------ progress

    def pump(self) -> None:
        """Everything that can happen now without waiting."""
        for peer in self.socks:
            if peer not in self.dead:
                self._receive(peer)
                self._flush(peer)
        self._write()

    def progress(self, ex: Exchange, until: Callable[[], bool]) -> None:
        """Pump until `until()`; raises `_PeerError` for a dead peer `ex` needs, or at the
        group's timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self.lock:
                if self.broken is not None:
                    raise self.broken
                try:
                    self.pump()
                except _PeerError as e:
                    self.broken = e
                    raise
                if until():
                    return
                needed = sorted(ex.waiting) + [w.peer for w in self.writes if w.exchange is ex]
                gone = [p for p in dict.fromkeys(needed) if p in self.dead]
                if gone:  # every one named: the first found may only have failed after another
                    raise _PeerError(
                        gone[0],
                        " and ".join(f"rank {p} (pid {self.pids[p]}) {self.dead[p]}" for p in gone)
                        + f" while this rank waited for {'it' if len(gone) == 1 else 'them'}",
                    )
                readable = [self.socks[p] for p in self.socks if p not in self.dead]
                writable = [
                    self.socks[p] for p, box in self.outbox.items() if box and p not in self.dead
                ]
            left = deadline - time.monotonic()
            if left <= 0:
                peer = needed[0] if needed else -1
                raise _PeerError(
                    peer,
                    f"timed out after {self.timeout_s:.0f} s waiting for rank {peer} "
                    "(for its part, or to take this rank's)",
                )
            select.select(readable, writable, [], min(left, 0.2))  # threads may wait together

    def held_bytes(self) -> int:
        """Bytes of shared memory this rank holds for the group (its own rings)."""
        return self.ring.capacity + sum(r.capacity for r in self.old_rings)

    def close(self) -> None:
        """Drop the sockets (in a forked child: the parent's peers must see its exit)."""
        for sock in self.socks.values():
            sock.close()
        self.dead = {p: "is unreachable from a forked child" for p in self.socks}


class Exchange:
    """One issued all-to-all-v through shared memory; `wait()` completes it (`hooks`: `Hooks`)."""

    def __init__(
        self,
        group: _Group,
        name: str,
        wire: torch.Tensor,
        input_sizes: List[int],
        output_sizes: List[int],
        out: torch.Tensor,
        hooks: Hooks = NO_HOOKS,
    ) -> None:
        self.group, self.name, self.site = group, name, _hash(name)
        self.hooks = hooks
        me, ws, elem = group.rank, group.world_size, wire.element_size()
        self.wire, self.wire_bytes = wire, wire.view(torch.uint8)
        self.out_bytes = out.view(torch.uint8)
        at = [0] * (ws + 1)
        arrive = [0] * (ws + 1)
        for r in range(ws):
            at[r + 1] = at[r] + input_sizes[r] * elem
            arrive[r + 1] = arrive[r] + output_sizes[r] * elem
        self.arrive = arrive
        self.expect = [output_sizes[r] * elem for r in range(ws)]
        self.got = [0] * ws
        self.waiting = {r for r in range(ws) if r != me}
        if not hooks.skip_self:
            self.out_bytes[arrive[me] : arrive[me + 1]].copy_(self.wire_bytes[at[me] : at[me + 1]])
        peers = [(me + step) % ws for step in range(1, ws)]
        with group.lock:
            if group.broken is not None:  # an earlier call failed: so do later ones
                raise collective_error(name, OP, group.pg, group.broken)
            self._guard(group.pump)  # acknowledgements first: they decide the ring's size
            group.calls += 1
            self.call = group.calls
            self.unwritten = ws - 1
            group.open[self.call] = self
            group._resize(at[ws] - (at[me + 1] - at[me]))
            for peer in peers:
                group.writes.append(_Write(self, peer, at[peer], at[peer + 1] - at[peer]))
            for item in group.stash.pop(self.call, []):
                self._guard(lambda item=item: group._apply(self, *item))
            self._guard(group.pump)

    def _guard(self, step: Callable[[], None]) -> None:
        try:
            step()
        except _PeerError as e:
            self.group.broken = e
            raise collective_error(self.name, OP, self.group.pg, e) from e

    def done(self) -> bool:
        return not self.waiting and not self.unwritten

    def wait(self) -> None:
        """Until every peer's part has arrived in the output and this rank's parts are all in
        its ring; raises `CollectiveError` naming a peer that died or broke the protocol."""
        if self.done():
            return
        try:
            self.group.progress(self, self.done)
        except _PeerError as e:
            raise collective_error(self.name, OP, self.group.pg, e) from e


_groups: Dict[dist.ProcessGroup, _Group | None] = {}
_groups_lock = threading.Lock()


def _forget_in_child() -> None:
    for group in _groups.values():
        if group is not None:
            group.close()
    _groups.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def group_for(pg: dist.ProcessGroup) -> _Group | None:
    """The shared-memory state of `pg`, or None when it goes through the backend. Decided once
    per group at its first all-to-all, collectively: every rank must call this then."""
    with _groups_lock:
        if pg not in _groups:
            agreed = shm_setup.agree(pg)
            _groups[pg] = None if agreed is None else _Group(pg, *agreed)
        return _groups[pg]


def held_bytes(pg: dist.ProcessGroup) -> int:
    """Bytes of shared memory this rank holds for `pg` now (0 when `pg` uses the backend)."""
    group = _groups.get(pg)
    return 0 if group is None else group.held_bytes()


def issue(
    pg: dist.ProcessGroup,
    wire: torch.Tensor,
    input_sizes: List[int],
    output_sizes: List[int],
    out: torch.Tensor,
    name: str,
    hooks: Hooks = NO_HOOKS,
) -> Exchange | None:
    """Start an all-to-all-v of `wire` (contiguous, CPU) into `out` through shared memory, or
    None when `pg` goes through the backend (then the caller issues it there)."""
    group = group_for(pg)
    if group is None:
        return None
    return Exchange(group, name, wire, input_sizes, output_sizes, out, hooks)
