"""Name the peers a failed collective could not reach.

A collective that loses a peer ends in the backend's words ("Timed out waiting 300000ms for
send operation to complete") without saying who is missing. At start every rank opens a
listening socket and learns every other rank's host, address and port (one all-gather).
When the job then fails with a RuntimeError (a collective error, a timeout, a failed
checkpoint save), each rank dials every other rank's socket: a host whose link is down times
out, a host whose process died refuses. If any peer is unreachable, the error is re-raised
with their ranks, host names and addresses; otherwise the original error goes out unchanged.

The listening socket is never accepted from: the kernel completes a probe's handshake on
its own, so it costs nothing while training runs.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch.distributed as dist

PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Peer:
    """Where a rank listens: its host name, the address it reaches the others from, a port."""

    rank: int
    host: str
    address: str
    port: int

    def __str__(self) -> str:
        return f"rank {self.rank} on {self.host} ({self.address}:{self.port})"


def _own_address() -> str:
    """The address of the interface that routes to MASTER_ADDR (no packet is sent)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, 9))
        return probe.getsockname()[0]


def _dial(peer: Peer, timeout_s: float) -> str | None:
    """None when `peer` answers, else why not ("timed out", "connection refused", ...)."""
    try:
        with socket.create_connection((peer.address, peer.port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:.0f}s (host or link down)"
    except ConnectionRefusedError:
        return "connection refused (its process is gone)"
    except OSError as e:
        return e.strerror or type(e).__name__


class PeerDirectory:
    """This rank's listening socket and every rank's `Peer` (collective to build)."""

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("0.0.0.0", 0))
        self._listener.listen(128)
        rank = dist.get_rank()
        me = Peer(rank, socket.gethostname(), _own_address(), self._listener.getsockname()[1])
        peers: List[Peer | None] = [None] * dist.get_world_size()
        dist.all_gather_object(peers, me)
        self.me = me
        self.others = [p for p in peers if p is not None and p.rank != rank]

    def unreachable(self, timeout_s: float = PROBE_TIMEOUT_S) -> List[Tuple[Peer, str]]:
        """The peers that do not answer now, with the reason, dialed side by side."""
        if not self.others:
            return []
        with ThreadPoolExecutor(max_workers=min(64, len(self.others))) as pool:
            reasons = list(pool.map(lambda p: _dial(p, timeout_s), self.others))
        return [(peer, why) for peer, why in zip(self.others, reasons) if why is not None]

    def close(self) -> None:
        self._listener.close()


@contextmanager
def naming_unreachable_peers() -> Iterator[None]:
    """Run the body; if it raises a RuntimeError while peers are unreachable, raise one that
    names them (the original is its cause). Needs the default process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    directory = PeerDirectory()
    try:
        yield
    except RuntimeError as error:
        lost = directory.unreachable()
        if not lost:
            raise
        names = "; ".join(f"{peer}: {why}" for peer, why in lost)
        raise RuntimeError(
            f"rank {directory.me.rank} on {directory.me.host} cannot reach "
            f"{len(lost)} peer(s): {names}. It failed with: {error}"
        ) from error
    finally:
        directory.close()
