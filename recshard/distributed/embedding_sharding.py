"""TorchRec's `torchrec.distributed.embedding_sharding` names a port may use:
`KJTListAwaitable` waits a list of per-sharding feature awaitables into one `KJTList`."""

from __future__ import annotations

from typing import Any, List

from recshard.distributed.embedding_types import KJTList
from recshard.sparse import KeyedJaggedTensor
from recshard.types import Awaitable

__all__ = ["KJTList", "KJTListAwaitable"]


class KJTListAwaitable(Awaitable[KJTList]):
    """`KJTList` of the waited `awaitables`, in order; `ctx` is the sharded module's context,
    kept for the caller."""

    def __init__(self, awaitables: List[Awaitable[KeyedJaggedTensor]], ctx: Any) -> None:  # noqa: ANN401
        super().__init__()
        self.awaitables = awaitables
        self.ctx = ctx

    def _wait_impl(self) -> KJTList:
        return KJTList([awaitable.wait() for awaitable in self.awaitables])
