"""The input verdict exchange: every rank learns whether any rank rejected its batch.

A sharded module whose step has a KJT all-to-all sends its verdict in that exchange's splits
(`kjt.py`). A step without one (every table data-parallel) would otherwise let a
rank that rejected its batch raise alone while the others run on into the gradient all-reduce
and pair it with the wrong step; such a step makes this one small exchange instead, before any
other collective: an all-gather of `[1 + 16]` int64 per rank (a flag and the first line of the
message, as in the splits exchange). The rejecting rank raises `ValueError(message)`, every other
rank `RuntimeError("rank R rejected its input: message")`.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from recshard.comm.request import wait_work
from recshard.types import Awaitable

MSG_BYTES = 128  # first line of a rejecting rank's message rides along, truncated
MSG_WORDS = MSG_BYTES // 8


def encode_message(message: str) -> torch.Tensor:
    """`[MSG_WORDS]` int64: the message's first line, UTF-8, cut at a character boundary."""
    first = (message.strip().splitlines() or [""])[0]
    data = first.encode("utf-8")[:MSG_BYTES].decode("utf-8", errors="ignore").encode("utf-8")
    padded = bytearray(data.ljust(MSG_BYTES, b"\0"))
    return torch.frombuffer(padded, dtype=torch.int64).clone()


def decode_message(words: torch.Tensor) -> str:
    return words.cpu().numpy().tobytes().rstrip(b"\0").decode("utf-8", errors="ignore")


def raise_rejected(own_error: str | None, flags: List[int], messages: torch.Tensor) -> None:
    """Raise if this rank (`own_error`) or any rank (`flags[r]` set) rejected its input;
    `messages[r]` holds rank r's encoded message."""
    if own_error is not None:
        raise ValueError(own_error)
    rejected = [r for r, flag in enumerate(flags) if flag]
    if rejected:
        rank = rejected[0]
        message = decode_message(messages[rank]) or f"see rank {rank}"
        raise RuntimeError(f"rank {rank} rejected its input: {message}")


class VerdictAwaitable(Awaitable[None]):
    """The exchange in flight; `wait()` returns if every rank accepted its batch, else raises."""

    def __init__(self, pg: dist.ProcessGroup, error: str | None, device: torch.device) -> None:
        super().__init__()
        self._pg, self._error = pg, error
        mine = torch.zeros(1 + MSG_WORDS, dtype=torch.int64, device="cpu")  # built on the host
        if error is not None:
            mine[0] = 1
            mine[1:] = encode_message(error)
        if dist.get_backend(pg) == "nccl":  # NCCL needs device tensors; gloo takes host ones
            mine = mine.to(device)
        self._gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
        self._work = dist.all_gather(self._gathered, mine, group=pg, async_op=True)

    def _wait_impl(self) -> None:
        wait_work(self._work, "input verdict", op="all_gather", pg=self._pg)
        table = torch.stack(self._gathered).cpu()
        raise_rejected(self._error, table[:, 0].tolist(), table[:, 1:])


def exchange_verdict(
    pg: dist.ProcessGroup | None, error: str | None, device: torch.device
) -> VerdictAwaitable | None:
    """Start the exchange on `pg` (None when there is nobody to tell: one rank, no group)."""
    if pg is None or not dist.is_initialized() or dist.get_world_size(pg) == 1:
        return None
    return VerdictAwaitable(pg, error, device)
