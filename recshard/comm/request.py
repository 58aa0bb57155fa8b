"""Collectives that join autograd: issued now, waited later, transposed in backward.

Three dual pairs carry every embedding collective in recshard (Megatron's mappings, made
asynchronous):

    all-to-all-v (splits in, out)  <->  all-to-all-v (splits out, in)
    reduce-scatter(-v)             <->  all-gather(-v)
    all-gather                     <->  reduce-scatter

Each is a `Collective` whose `forward` issues the op with `async_op=True` and whose
`backward` issues its transpose. `CommRequest` wires one into autograd with two tiny
Functions: `_Issue` (input -> token, at call time) and `_Finish` (token -> output, at
`wait()`). Gradients flow output -> `_Finish.backward` (issues the transposed collective)
-> other backward work -> `_Issue.backward` (waits for it), so the backward collective
overlaps autograd work too. Reshapes around the flat collectives (split by rank, cat by
columns) are ordinary differentiable torch ops.
"""

from __future__ import annotations

import abc
import logging
from collections import defaultdict
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.autograd import Function

from recshard.comm.codecs import QuantizedCommCodec
from recshard.types import Awaitable

logger = logging.getLogger(__name__)

_GRADIENT_DIVISION = True
_USE_NATIVE_REDUCE_SCATTER = True
_PAYLOAD_BYTES: Dict[str, int] = defaultdict(int)


def set_gradient_division(val: bool) -> None:
    """Whether model-parallel backwards divide embedding gradients by the world size
    (default True: updates then match DDP's gradient averaging)."""
    global _GRADIENT_DIVISION
    _GRADIENT_DIVISION = val


def get_gradient_division() -> bool:
    return _GRADIENT_DIVISION


def set_use_native_reduce_scatter(val: bool) -> None:
    """Use the backend's reduce-scatter (default) or all-to-all plus a local sum."""
    global _USE_NATIVE_REDUCE_SCATTER
    _USE_NATIVE_REDUCE_SCATTER = val


def comm_payload_bytes() -> Dict[str, int]:
    """Bytes this process has handed to each kind of collective since the last reset."""
    return dict(_PAYLOAD_BYTES)


def reset_comm_payload_bytes() -> None:
    _PAYLOAD_BYTES.clear()


class Pending:
    """An issued collective: its work handle(s) and how to read the result when done."""

    def __init__(self, works: List[Optional[dist.Work]], finish: Callable[[], torch.Tensor]):
        self._works = works
        self._finish = finish

    def wait(self) -> torch.Tensor:
        for work in self._works:
            if work is not None:
                work.wait()
        return self._finish()


# ----------------------------------------------------------------------------- primitives


def _encode(x: torch.Tensor, codec: Optional[QuantizedCommCodec]) -> torch.Tensor:
    return (x if codec is None else codec.encode(x)).contiguous()


def _decode(
    x: torch.Tensor, codec: Optional[QuantizedCommCodec], dtype: torch.dtype
) -> torch.Tensor:
    return (x if codec is None else codec.decode(x)).to(dtype)


def _sizes(splits: List[int], codec: Optional[QuantizedCommCodec]) -> List[int]:
    return splits if codec is None else [codec.calc_quantized_size(s) for s in splits]


def issue_all_to_all(
    x: torch.Tensor,
    input_splits: List[int],
    output_splits: List[int],
    pg: dist.ProcessGroup,
    codec: Optional[QuantizedCommCodec] = None,
    name: str = "all_to_all",
) -> Pending:
    """Flat all-to-all-v: `x[1-D]` sends `input_splits[r]` elements to rank r; the result
    holds `output_splits[r]` elements from each rank r, in rank order."""
    wire = _encode(x, codec)
    out = wire.new_empty(sum(_sizes(output_splits, codec)))
    _PAYLOAD_BYTES[name] += wire.numel() * wire.element_size()
    work = dist.all_to_all_single(
        out, wire, _sizes(output_splits, codec), _sizes(input_splits, codec),
        group=pg, async_op=True,
    )
    return Pending([work], lambda: _decode(out, codec, x.dtype))


def issue_reduce_scatter(
    x: torch.Tensor,
    input_splits: List[int],
    pg: dist.ProcessGroup,
    codec: Optional[QuantizedCommCodec] = None,
    name: str = "reduce_scatter",
) -> Pending:
    """Flat reduce-scatter-v: `x[1-D]` is cut into `input_splits` chunks; rank r gets the
    sum over ranks of chunk r. Native where the backend has it (gloo does in torch 2.13),
    else all-to-all plus a local sum."""
    rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
    wire = _encode(x, codec)
    sizes = _sizes(input_splits, codec)
    _PAYLOAD_BYTES[name] += wire.numel() * wire.element_size()
    if not _USE_NATIVE_REDUCE_SCATTER:
        received = wire.new_empty(sizes[rank] * world_size)
        work = dist.all_to_all_single(
            received, wire, [sizes[rank]] * world_size, sizes, group=pg, async_op=True
        )
        return Pending(
            [work],
            lambda: _decode(received.view(world_size, -1).sum(0), codec, x.dtype),
        )
    out = wire.new_empty(sizes[rank])
    if len(set(sizes)) == 1:
        work = _reduce_scatter_single(out, wire, pg)
    else:
        work = dist.reduce_scatter(out, list(wire.split(sizes)), group=pg, async_op=True)
    return Pending([work], lambda: _decode(out, codec, x.dtype))


def issue_all_gather(
    x: torch.Tensor,
    output_splits: List[int],
    pg: dist.ProcessGroup,
    codec: Optional[QuantizedCommCodec] = None,
    name: str = "all_gather",
) -> Pending:
    """Flat all-gather-v: every rank's `x[1-D]` (rank r's has `output_splits[r]` elements),
    concatenated in rank order. Uneven sizes go through all-to-all on gloo (its all-gather
    needs equal sizes)."""
    world_size = dist.get_world_size(pg)
    wire = _encode(x, codec)
    sizes = _sizes(output_splits, codec)
    out = wire.new_empty(sum(sizes))
    _PAYLOAD_BYTES[name] += wire.numel() * wire.element_size()
    if len(set(sizes)) == 1:
        work = _all_gather_single(out, wire, pg)
    elif dist.get_backend(pg) == "nccl":
        work = dist.all_gather(list(out.split(sizes)), wire, group=pg, async_op=True)
    else:
        send = wire.repeat(world_size)
        work = dist.all_to_all_single(
            out, send, sizes, [wire.numel()] * world_size, group=pg, async_op=True
        )
    return Pending([work], lambda: _decode(out, codec, x.dtype))


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, pg: dist.ProcessGroup):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, group=pg, async_op=True)


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, pg: dist.ProcessGroup):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=pg, async_op=True)


# ----------------------------------------------------------------------------- collectives


class Collective(abc.ABC):
    """A flat collective and its transpose: `forward(x)` issues one, `backward(grad)` the other.

    `divide_grad`: the backward result is divided by the world size when gradient division
    is on (embedding collectives; not the generic `alltoallv`).
    """

    def __init__(self, pg: dist.ProcessGroup, divide_grad: bool = True) -> None:
        self.pg = pg
        self.divide_grad = divide_grad

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> Pending: ...

    @abc.abstractmethod
    def backward(self, grad: torch.Tensor) -> Pending: ...


class AllToAllV(Collective):
    """Send `input_splits[r]` elements to rank r; backward sends the gradients back."""

    def __init__(self, pg, input_splits, output_splits, codecs=None, divide_grad=True, name="a2a"):
        super().__init__(pg, divide_grad)
        self.input_splits, self.output_splits = list(input_splits), list(output_splits)
        self.codecs, self.name = codecs, name

    def forward(self, x: torch.Tensor) -> Pending:
        codec = self.codecs.forward if self.codecs else None
        return issue_all_to_all(x, self.input_splits, self.output_splits, self.pg, codec, self.name)

    def backward(self, grad: torch.Tensor) -> Pending:
        codec = self.codecs.backward if self.codecs else None
        return issue_all_to_all(
            grad, self.output_splits, self.input_splits, self.pg, codec, self.name + "_bwd"
        )


class ReduceScatterV(Collective):
    """Sum chunk r of every rank's input onto rank r; backward all-gathers the gradient."""

    def __init__(self, pg, input_splits, codecs=None, divide_grad=True, name="reduce_scatter"):
        super().__init__(pg, divide_grad)
        self.input_splits, self.codecs, self.name = list(input_splits), codecs, name

    def forward(self, x: torch.Tensor) -> Pending:
        codec = self.codecs.forward if self.codecs else None
        return issue_reduce_scatter(x, self.input_splits, self.pg, codec, self.name)

    def backward(self, grad: torch.Tensor) -> Pending:
        codec = self.codecs.backward if self.codecs else None
        return issue_all_gather(grad, self.input_splits, self.pg, codec, self.name + "_bwd")


class AllGatherV(Collective):
    """Concatenate every rank's input in rank order; backward reduce-scatters the gradient."""

    def __init__(self, pg, output_splits, codecs=None, divide_grad=True, name="all_gather"):
        super().__init__(pg, divide_grad)
        self.output_splits, self.codecs, self.name = list(output_splits), codecs, name

    def forward(self, x: torch.Tensor) -> Pending:
        codec = self.codecs.forward if self.codecs else None
        return issue_all_gather(x, self.output_splits, self.pg, codec, self.name)

    def backward(self, grad: torch.Tensor) -> Pending:
        codec = self.codecs.backward if self.codecs else None
        return issue_reduce_scatter(grad, self.output_splits, self.pg, codec, self.name + "_bwd")


# ----------------------------------------------------------------------------- autograd


class _Issue(Function):
    """input -> token: issues the forward collective; backward waits for the transposed one."""

    @staticmethod
    def forward(ctx, request: CommRequest, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.request = request
        request._pending = request.collective.forward(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):  # noqa: ANN001, ANN205
        request: CommRequest = ctx.request
        assert request._grad_pending is not None, "the output's backward did not run"
        grad = request._grad_pending.wait()
        request._grad_pending = None
        collective = request.collective
        if collective.divide_grad and _GRADIENT_DIVISION:
            grad = grad / dist.get_world_size(collective.pg)
        return None, grad


class _Finish(Function):
    """token -> output: waits for the forward collective; backward issues the transpose."""

    @staticmethod
    def forward(ctx, request: CommRequest, token: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.request = request
        pending, request._pending = request._pending, None
        return pending.wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        request: CommRequest = ctx.request
        request._grad_pending = request.collective.backward(grad.contiguous())
        return None, grad.new_empty(0)


class CommRequest(Awaitable[torch.Tensor]):
    """An in-flight collective on `x`; `wait()` returns `post(result)`, joined to autograd.

    `post` reshapes the flat result (e.g. per-rank blocks to columns); it is ordinary torch
    code, so autograd derives its backward.
    """

    def __init__(
        self,
        collective: Collective,
        x: torch.Tensor,
        post: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        super().__init__()
        self.collective = collective
        self._post = post
        self._pending: Optional[Pending] = None
        self._grad_pending: Optional[Pending] = None
        self._token = _Issue.apply(self, x.contiguous())

    def _wait_impl(self) -> torch.Tensor:
        out = _Finish.apply(self, self._token)
        self._token = None
        return out if self._post is None else self._post(out)
