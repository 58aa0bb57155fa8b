"""All-to-all-v through shared memory for process groups whose ranks all run on one host.

gloo moves an all-to-all between ranks of one host over loopback TCP; the sharded step spends
about 14% of its time there (benchmarks/README.md, "shared memory"). Here each rank writes
what it sends into its own files in /dev/shm, and every peer copies its chunk straight out:
the same copies gloo makes, without the sockets.

Layout. At a group's first all-to-all every rank agrees, collectively, whether the group is
eligible (same hostname and boot id on all ranks, world size >= 2, nobody set
`RECSHARD_SHM_ALL_TO_ALL=0`). Each rank then maps a small control segment of every rank.
Every call site (`name`) gets its own sequence of calls (1, 2, ...) and `SLOTS` slots per
writer: call s uses slot s % SLOTS, a data segment of the writer that grows (a new file, a
new generation) when a call needs more. The writer publishes, in its control segment, the
slot's sequence number, generation, capacity and where each destination's chunk starts;
a reader waits for that sequence number, maps a new generation by name, copies its chunk and
acknowledges. A writer reuses a slot only when every peer has acknowledged the call SLOTS
before; at issue it first completes its own calls that far behind that were never waited (a
pipeline that stops early drops its in-flight batches), so with more than SLOTS calls of one
site in flight, issue waits like a synchronous collective instead of deadlocking.

Files are unlinked as soon as every rank has mapped them (control segments at set-up, data
segments by whichever rank maps a generation last) and by a rank that gives up on an error:
nothing stays in /dev/shm. Waits spin briefly, then sleep in growing steps (ranks may
outnumber cores) and raise a `CollectiveError` naming the collective and the rank that did
not arrive once the group's timeout (`recshard.comm.pg.pg_timeout`) runs out, or at once
when that rank's process has exited (as gloo sees a closed socket).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import math
import mmap
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Set

import numpy as np
import torch
import torch.distributed as dist

from recshard.comm.errors import CollectiveError, collective_error
from recshard.comm.pg import pg_timeout

logger = logging.getLogger(__name__)

ENV = "RECSHARD_SHM_ALL_TO_ALL"
SLOTS = 4  # calls of one site that may be in flight before a writer defers its write
MAX_SITES = 64  # call sites per group; later ones go through the backend
_DIR = "/dev/shm"
_MIN_BYTES = 1 << 20
OP = "shm all_to_all"
_SPINS = 200


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class _Layout:
    """Where things sit in a rank's control segment (int64 words)."""

    world_size: int

    @property
    def slot_words(self) -> int:  # seq, gen, capacity, world_size + 1 chunk offsets
        return 3 + self.world_size + 1

    @property
    def site_words(self) -> int:  # name hash, slots, then acks and mapped generations per reader
        return 1 + SLOTS * self.slot_words + 2 * self.world_size * SLOTS

    def site(self, index: int) -> int:
        return index * self.site_words

    def slot(self, index: int, slot: int) -> int:
        return self.site(index) + 1 + slot * self.slot_words

    def ack(self, index: int, reader: int, slot: int) -> int:
        return self.site(index) + 1 + SLOTS * self.slot_words + reader * SLOTS + slot

    def mapped(self, index: int, reader: int, slot: int) -> int:
        return self.ack(index, reader, slot) + self.world_size * SLOTS

    @property
    def words(self) -> int:
        return MAX_SITES * self.site_words


@dataclass
class _Site:
    """One call site of a group: its index, its sequence, and the segments mapped for it."""

    index: int
    seq: int = 0
    own: Dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> this rank's segment
    own_gen: Dict[int, int] = field(default_factory=dict)
    peers: Dict[tuple, tuple] = field(default_factory=dict)  # (writer, slot) -> (gen, segment)
    unfinished: List[Exchange] = field(default_factory=list)  # issued, not read yet, in order


class _Group:
    """The shared-memory state of one eligible process group on this rank."""

    def __init__(self, pg: dist.ProcessGroup, token: str, pids: List[int]) -> None:
        self.pg, self.token, self.pids = pg, token, pids
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.layout = _Layout(self.world_size)
        self.timeout_s = pg_timeout(pg).total_seconds()
        self.sites: Dict[str, _Site | None] = {}
        self.linked: Set[str] = set()  # files of this rank not yet unlinked
        self.lock = threading.Lock()
        size = self.layout.words * 8
        own = self._path(f"ctl-{self.rank}")
        with open(own, "wb") as f:
            f.truncate(size)
        dist.barrier(group=pg)
        self.controls = [
            torch.from_file(self._path(f"ctl-{r}"), shared=True, size=size, dtype=torch.uint8)
            .numpy()
            .view(np.int64)
            for r in range(self.world_size)
        ]
        dist.barrier(group=pg)
        os.unlink(own)

    def _path(self, what: str) -> str:
        return f"{_DIR}/recshard-{self.token}-{what}"

    def _data_path(self, writer: int, index: int, slot: int, gen: int) -> str:
        return self._path(f"{writer}-{index}-{slot}-{gen}")

    def site(self, name: str) -> _Site | None:
        """The site `name`, made at its first call (None past MAX_SITES: the backend's)."""
        if name not in self.sites:
            index = len(self.sites)
            self.sites[name] = _Site(index) if index < MAX_SITES else None
            if index < MAX_SITES:
                self.controls[self.rank][self.layout.site(index)] = _hash(name)
        return self.sites[name]

    def give_up(self) -> None:
        """Unlink this rank's files that peers have not mapped yet (it stops on an error)."""
        for path in list(self.linked):
            _unlink(path)
        self.linked.clear()


def _hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


def _unlink(path: str) -> str:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return path


def _alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _starts(sizes: List[int]) -> List[int]:
    """Where each rank's chunk starts, and the end."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


_groups: Dict[dist.ProcessGroup, _Group | None] = {}
_groups_lock = threading.Lock()


@atexit.register
def _unlink_at_exit() -> None:
    """Files a peer never mapped (its last request was never waited) go at a normal exit."""
    for group in _groups.values():
        if group is not None:
            group.give_up()


def resident_bytes(calls: Sequence[float]) -> float:
    """Bytes that one call site keeps resident in one rank's memory once every slot has been
    used, when each step issues calls through it that move `calls` bytes each, in this order
    (pass what the rank writes for its peers, or what it reads from them): call `seq` of a
    site uses slot `seq % SLOTS`, a slot's segment stays mapped with every page a call wrote
    or read in it, so each slot holds the largest call that lands in it, in whole pages. Both
    sides count: the writer's pages in its own segments, the reader's in the peers' (shared
    pages count in every process that touched them)."""
    held = [0.0] * SLOTS
    for seq in range(1, SLOTS * len(calls) + 1):  # every (call, slot) pairing recurs by then
        size = calls[(seq - 1) % len(calls)]
        pages = math.ceil(size / mmap.PAGESIZE) * mmap.PAGESIZE
        held[seq % SLOTS] = max(held[seq % SLOTS], pages)
    return sum(held)


def enabled() -> bool:
    """False when `RECSHARD_SHM_ALL_TO_ALL=0` (read at a group's first all-to-all)."""
    return os.environ.get(ENV, "1").strip() != "0"


def group_for(pg: dist.ProcessGroup) -> _Group | None:
    """The shared-memory state of `pg`, or None when it goes through the backend. Decided once
    per group at its first all-to-all, collectively: every rank must call this then."""
    with _groups_lock:
        if pg not in _groups:
            _groups[pg] = _agree(pg)
        return _groups[pg]


def _node() -> int:
    """This rank's node in torchrun's layout (global rank // LOCAL_WORLD_SIZE; 0 without
    one): ranks that simulate several hosts on one machine keep their traffic across
    "hosts" off shared memory, as on real hosts."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return dist.get_rank() // int(local) if local and dist.is_initialized() else 0


def _agree(pg: dist.ProcessGroup) -> _Group | None:
    world_size = dist.get_world_size(pg)
    if world_size < 2:
        return None
    mine = (
        enabled(),
        (socket.gethostname(), _boot_id(), _node()),
        os.path.isdir(_DIR),
        os.urandom(8).hex(),
        os.getpid(),
    )
    everyone: List[tuple] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=pg)
    if not all(e[0] and e[2] and e[1] == everyone[0][1] and e[1][1] for e in everyone):
        return None
    try:
        return _Group(pg, everyone[0][3], [e[4] for e in everyone])
    except OSError as e:  # /dev/shm full or not writable: the ranks could now disagree
        raise collective_error("shm_setup", OP, pg, e, stage="could not start") from e


class Exchange:
    """One issued all-to-all-v through shared memory; `wait()` completes it (waits, copies)."""

    def __init__(
        self,
        group: _Group,
        site: _Site,
        name: str,
        wire: torch.Tensor,
        input_sizes: List[int],
        output_sizes: List[int],
        out: torch.Tensor,
    ) -> None:
        self.group, self.site, self.name = group, site, name
        self.wire, self.input_sizes, self.output_sizes, self.out = (
            wire,
            input_sizes,
            output_sizes,
            out,
        )
        with group.lock:
            site.seq += 1
            self.seq = site.seq
        self.slot = self.seq % SLOTS
        self.deadline = time.monotonic() + group.timeout_s  # for waiting for the slot
        me = group.rank
        at, arrive = _starts(input_sizes), _starts(output_sizes)
        out[arrive[me] : arrive[me + 1]].copy_(wire[at[me] : at[me + 1]])
        self.done = False
        for earlier in [e for e in site.unfinished if e.seq <= self.seq - SLOTS]:
            earlier.wait()  # never waited (a pipeline dropped it), or SLOTS calls behind
        site.unfinished.append(self)
        ctl, layout = group.controls[me], group.layout
        for r in range(group.world_size):
            if r != me:
                self._wait(
                    lambda r=r: ctl[layout.ack(site.index, r, self.slot)] >= self.seq - SLOTS,
                    r,
                    "to take the all-to-all before",
                )
        self._write()

    def _fail(self, peer: int, what: str) -> CollectiveError:
        self.group.give_up()
        return collective_error(
            self.name,
            OP,
            self.group.pg,
            TimeoutError(
                f"timed out after {self.group.timeout_s:.0f} s waiting for rank {peer} {what}"
            ),
        )

    def _write(self) -> None:
        """Copy the chunks for the peers into this rank's slot and publish the sequence number."""
        g, layout, index, slot = self.group, self.group.layout, self.site.index, self.slot
        me, ctl = g.rank, g.controls[g.rank]
        elem = self.wire.element_size()
        sizes = [0 if r == me else self.input_sizes[r] * elem for r in range(g.world_size)]
        needed = sum(sizes)
        base = layout.slot(index, slot)
        segment = self.site.own.get(slot)
        if segment is not None:  # every peer took the call before from it, so has it mapped
            g.linked.discard(_unlink(g._data_path(me, index, slot, self.site.own_gen[slot])))
        if needed and (segment is None or segment.numel() < needed):
            gen = self.site.own_gen.get(slot, 0) + 1
            capacity = max(_MIN_BYTES, 1 << (needed - 1).bit_length())
            path = g._data_path(me, index, slot, gen)
            with open(path, "wb") as f:
                f.truncate(capacity)
            g.linked.add(path)
            segment = torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8)
            self.site.own[slot], self.site.own_gen[slot] = segment, gen
            ctl[base + 1], ctl[base + 2] = gen, capacity
            ctl[layout.mapped(index, me, slot)] = gen
        at = _starts(self.input_sizes)
        offset = 0
        for r in range(g.world_size):
            ctl[base + 3 + r] = offset
            if sizes[r]:
                segment[offset : offset + sizes[r]].view(self.wire.dtype).copy_(
                    self.wire[at[r] : at[r + 1]]
                )
            offset += sizes[r]
        ctl[base + 3 + g.world_size] = offset
        ctl[base] = self.seq  # last: readers take the chunks once they see it

    def wait(self) -> None:
        """Copy every peer's chunk for this rank out of its segment and acknowledge (earlier
        calls of this site first, so reads follow issue order). Once only."""
        if self.done:
            return
        g = self.group
        self.deadline = time.monotonic() + g.timeout_s
        while self.site.unfinished[0] is not self:
            self.site.unfinished[0].wait()
        arrive = _starts(self.output_sizes)
        for step in range(1, g.world_size):
            peer = (g.rank + step) % g.world_size
            self._read(peer, arrive[peer], arrive[peer + 1])
        self.wire, self.done = None, True
        self.site.unfinished.pop(0)

    def _read(self, peer: int, start: int, end: int) -> None:
        g, layout, index, slot = self.group, self.group.layout, self.site.index, self.slot
        ctl = g.controls[peer]
        base = layout.slot(index, slot)
        self._wait(lambda: ctl[base] >= self.seq, peer, "to send its chunk")
        if ctl[layout.site(index)] != _hash(self.name):
            g.give_up()
            raise collective_error(
                self.name,
                OP,
                g.pg,
                RuntimeError(
                    f"rank {peer} issued a different collective at this point (ranks must issue "
                    "all-to-alls in the same order)"
                ),
            )
        elem = self.out.element_size()
        lo, hi = int(ctl[base + 3 + g.rank]), int(ctl[base + 4 + g.rank])
        if hi - lo != (end - start) * elem:
            g.give_up()
            raise collective_error(
                self.name,
                OP,
                g.pg,
                RuntimeError(
                    f"rank {peer} sends {hi - lo} bytes, this rank expects {(end - start) * elem}"
                ),
            )
        gen = int(ctl[base + 1])
        known = self.site.peers.get((peer, slot))
        if gen and (known is None or known[0] != gen):  # map it even if this rank's chunk is empty
            path = g._data_path(peer, index, slot, gen)
            try:
                segment = torch.from_file(
                    path, shared=True, size=int(ctl[base + 2]), dtype=torch.uint8
                )
            except (OSError, RuntimeError) as e:
                g.give_up()
                raise collective_error(self.name, OP, g.pg, e) from e
            known = self.site.peers[(peer, slot)] = (gen, segment)
            ctl[layout.mapped(index, g.rank, slot)] = gen
            if all(ctl[layout.mapped(index, r, slot)] >= gen for r in range(g.world_size)):
                _unlink(path)  # every rank has it mapped (else the writer does, at its next use)
        if hi > lo:
            self.out[start:end].copy_(known[1][lo:hi].view(self.out.dtype))
        ctl[layout.ack(index, g.rank, slot)] = self.seq

    def _wait(self, ready, peer: int, what: str) -> None:  # noqa: ANN001 - a predicate
        """Until `ready()`: spin a little, then sleep 20 us doubling to 1 ms, up to the deadline."""
        for _ in range(_SPINS):
            if ready():
                return
        pause = 2e-5
        while not ready():
            if time.monotonic() > self.deadline:
                raise self._fail(peer, what)
            if pause >= 1e-3 and not _alive(self.group.pids[peer]):  # gloo sees a closed socket
                self.group.give_up()
                raise collective_error(
                    self.name,
                    OP,
                    self.group.pg,
                    RuntimeError(
                        f"rank {peer} (pid {self.group.pids[peer]}) exited while this rank waited "
                        f"for it {what}"
                    ),
                )
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)


def issue(
    pg: dist.ProcessGroup,
    wire: torch.Tensor,
    input_sizes: List[int],
    output_sizes: List[int],
    out: torch.Tensor,
    name: str,
) -> Exchange | None:
    """Start an all-to-all-v of `wire` (contiguous, CPU) into `out` through shared memory, or
    None when `pg` goes through the backend (then the caller issues it there)."""
    if wire.device.type != "cpu":
        return None
    group = group_for(pg)
    if group is None:
        return None
    with group.lock:
        site = group.site(name)
    if site is None:
        return None
    return Exchange(group, site, name, wire, input_sizes, output_sizes, out)
