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
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from recshard.comm import buffers, transport
from recshard.comm.codecs import QuantizedCommCodec
from recshard.comm.errors import CollectiveError, collective_error
from recshard.comm.shm_hooks import Hooks
from recshard.types import Awaitable

logger = logging.getLogger(__name__)

_GRADIENT_DIVISION = True
_USE_NATIVE_REDUCE_SCATTER: bool | None = None
_PAYLOAD_BYTES: Dict[str, int] = defaultdict(int)


def set_gradient_division(val: bool) -> None:
    """Whether model-parallel backwards divide embedding gradients by the world size
    (default True: updates then match DDP's gradient averaging)."""
    global _GRADIENT_DIVISION
    _GRADIENT_DIVISION = val


def get_gradient_division() -> bool:
    return _GRADIENT_DIVISION


def set_use_native_reduce_scatter(val: bool | None) -> None:
    """True: the backend's reduce-scatter; False: all-to-all plus a local sum; None (default):
    all-to-all plus sum for CPU tensors (gloo's reduce-scatter clones and copies the whole
    input: the row-wise EBC step is ~10% faster, benchmarks/ebc.py), the backend's own for
    accelerator tensors (NCCL)."""
    global _USE_NATIVE_REDUCE_SCATTER
    _USE_NATIVE_REDUCE_SCATTER = val


def _native_reduce_scatter(device: torch.device) -> bool:
    if _USE_NATIVE_REDUCE_SCATTER is not None:
        return _USE_NATIVE_REDUCE_SCATTER
    return device.type != "cpu"


def comm_payload_bytes() -> Dict[str, int]:
    """Bytes this process has handed to each kind of collective since the last reset."""
    return dict(_PAYLOAD_BYTES)


def reset_comm_payload_bytes() -> None:
    _PAYLOAD_BYTES.clear()


def wait_work(
    work: transport.Work | None,
    name: str,
    op: str = "all_to_all_single",
    pg: dist.ProcessGroup | None = None,
) -> None:
    """`work.wait()`, re-raising a backend error as a `CollectiveError` that names `name`."""
    if work is None:
        return
    try:
        work.wait()
    except CollectiveError:
        raise
    except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
        raise collective_error(name, op, pg, e) from e


class Pending:
    """An issued collective: its work handle(s) and how to read the result when done.

    `wait()` raises `CollectiveError` naming `name` (and `op`, the backend call) when the
    backend reports a failure or the process-group timeout, instead of a bare gloo/NCCL error.
    """

    def __init__(
        self,
        works: List[transport.Work | None],
        finish: Callable[[], torch.Tensor],
        name: str = "collective",
        op: str = "collective",
        pg: dist.ProcessGroup | None = None,
    ) -> None:
        self._works = works
        self._finish = finish
        self.name, self._op, self._pg = name, op, pg

    def wait(self) -> torch.Tensor:
        for work in self._works:
            wait_work(work, self.name, self._op, self._pg)
        return self._finish()


# ----------------------------------------------------------------------------- primitives


def _encode(x: torch.Tensor, codec: QuantizedCommCodec | None) -> torch.Tensor:
    return (x if codec is None else codec.encode(x)).contiguous()


def decode(x: torch.Tensor, codec: QuantizedCommCodec | None, dtype: torch.dtype) -> torch.Tensor:
    """What arrived on the wire, decoded by `codec` (None: sent as is) to `dtype`."""
    return (x if codec is None else codec.decode(x)).to(dtype)


def _sizes(splits: List[int], codec: QuantizedCommCodec | None) -> List[int]:
    return splits if codec is None else [codec.calc_quantized_size(s) for s in splits]


def issue_all_to_all(
    x: torch.Tensor,
    input_splits: List[int],
    output_splits: List[int],
    pg: dist.ProcessGroup,
    codec: QuantizedCommCodec | None = None,
    name: str = "all_to_all",
    read: Callable[[torch.Tensor], torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    hooks: Hooks | None = None,
) -> Pending:
    """Flat all-to-all-v: `x[1-D]` sends `input_splits[r]` elements to rank r; the result
    holds `output_splits[r]` elements from each rank r, in rank order: `read(received)` of the
    wire buffer (`out` if given), by default decoded to `x`'s dtype. `hooks`: copies the caller
    makes itself where the transport is shared memory (`transport.all_to_all`)."""
    wire = _encode(x, codec)
    if out is None:
        out = buffers.take(name, sum(_sizes(output_splits, codec)), wire.dtype, wire.device)
    _PAYLOAD_BYTES[name] += wire.numel() * wire.element_size()
    finish = (lambda: read(out)) if read is not None else (lambda: decode(out, codec, x.dtype))
    work, op = transport.all_to_all(
        out,
        wire,
        _sizes(output_splits, codec),
        _sizes(input_splits, codec),
        pg,
        name,
        hooks,
    )
    return Pending([work], finish, name, op, pg)


def issue_reduce_scatter(
    x: torch.Tensor,
    input_splits: List[int],
    pg: dist.ProcessGroup,
    codec: QuantizedCommCodec | None = None,
    name: str = "reduce_scatter",
) -> Pending:
    """Flat reduce-scatter-v: `x[1-D]` is cut into `input_splits` chunks; rank r gets the
    sum over ranks of chunk r: the backend's reduce-scatter or all-to-all plus a local sum
    (`set_use_native_reduce_scatter`)."""
    rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
    wire = _encode(x, codec)
    sizes = _sizes(input_splits, codec)
    _PAYLOAD_BYTES[name] += wire.numel() * wire.element_size()
    if not _native_reduce_scatter(x.device):
        received = buffers.take(name, sizes[rank] * world_size, wire.dtype, wire.device)
        finish = lambda: decode(_sum_rows(received, world_size, name), codec, x.dtype)  # noqa: E731
        work, op = transport.all_to_all(received, wire, [sizes[rank]] * world_size, sizes, pg, name)
        return Pending([work], finish, name, op, pg)
    out = buffers.take(name, sizes[rank], wire.dtype, wire.device)
    work, op = transport.reduce_scatter(out, wire, sizes, pg, name)
    return Pending([work], lambda: decode(out, codec, x.dtype), name, op, pg)


def issue_all_gather(
    x: torch.Tensor,
    output_splits: List[int],
    pg: dist.ProcessGroup,
    codec: QuantizedCommCodec | None = None,
    name: str = "all_gather",
    divisor: int = 1,
) -> Pending:
    """Flat all-gather-v: every rank's `x` (rank r's has `output_splits[r]` elements),
    flattened and concatenated in rank order, divided by `divisor` (only without a codec).
    On gloo it goes through all-to-all (gloo's all-gather needs equal sizes, and allocates a
    flat output of its own, copied out after); the copy into its send buffer reads `x` with
    any strides and divides as it copies."""
    if codec is not None and divisor != 1:
        raise ValueError(f"issue_all_gather({name}): divisor {divisor} with a codec")
    world_size = dist.get_world_size(pg)
    gloo = dist.get_backend(pg) == "gloo"
    if gloo:
        wire = x if codec is None else _encode(x, codec)
    else:
        wire = _encode(x if divisor == 1 else x / divisor, codec)
    sizes = _sizes(output_splits, codec)
    out = buffers.take(name, sum(sizes), wire.dtype, wire.device)
    _PAYLOAD_BYTES[name] += wire.numel() * wire.element_size()
    if not gloo:
        work, op = transport.all_gather(out, wire, sizes, pg, name)
    else:  # every rank sends its whole input to every rank
        send = buffers.take(name + "_send", world_size * wire.numel(), wire.dtype, wire.device)
        copies = send.view(world_size, *wire.shape)
        copies[0].copy_(wire)
        if divisor != 1:
            copies[0].div_(divisor)  # a contiguous pass: faster than div(out=) from strides
        copies[1:].copy_(copies[0].unsqueeze(0).expand(copies[1:].shape))
        work, op = transport.all_to_all(out, send, sizes, [wire.numel()] * world_size, pg, name)
    return Pending([work], lambda: decode(out, codec, x.dtype), name, op, pg)


def _sum_rows(received: torch.Tensor, world_size: int, name: str) -> torch.Tensor:
    """The sum of the `world_size` equal blocks of `received`, in a reused buffer."""
    blocks = received.view(world_size, -1)
    out = buffers.take(name + "_sum", blocks.size(1), blocks.dtype, blocks.device)
    return torch.sum(blocks, 0, out=out)


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

    def backward_dividing(self, grad: torch.Tensor, divisor: int) -> Pending | None:
        """`backward(grad / divisor)` with the division done by the copy that packs the send
        buffer, from `grad` of any strides (the receiver then leaves it alone), or None where
        this collective cannot (a codec changes the values on the wire). Dividing before the
        send gives the same bits as dividing what arrives: nothing on the wire changes them."""
        return None


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

    def backward_dividing(self, grad: torch.Tensor, divisor: int) -> Pending | None:
        if self.codecs is not None and self.codecs.backward is not None:
            return None
        return issue_all_gather(grad, self.input_splits, self.pg, None, self.name + "_bwd", divisor)


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


class _Exchange:
    """What the autograd pair shares: the collective and its in-flight handles. The autograd
    nodes hold this, never the CommRequest: the request caches its result tensor, whose
    grad_fn would otherwise hold the request back (a cycle torch's autograd graph keeps alive:
    every step's activations leaked)."""

    __slots__ = ("collective", "pending", "grad_pending", "divided_before_send")

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self.pending: Pending | None = None
        self.grad_pending: Pending | None = None
        self.divided_before_send = False


def _divisor(collective: Collective) -> int:
    """What the gradient of `collective` is divided by (gradient division)."""
    if collective.divide_grad and _GRADIENT_DIVISION:
        return dist.get_world_size(collective.pg)
    return 1


class _Issue(Function):
    """input -> token: issues the forward collective; backward waits for the transposed one."""

    @staticmethod
    def forward(ctx, exchange: _Exchange, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.exchange = exchange
        exchange.pending = exchange.collective.forward(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):  # noqa: ANN001, ANN205
        exchange: _Exchange = ctx.exchange
        assert exchange.grad_pending is not None, "the output's backward did not run"
        grad = exchange.grad_pending.wait()
        exchange.grad_pending = None
        collective = exchange.collective
        if _divisor(collective) != 1 and not exchange.divided_before_send:
            grad.div_(_divisor(collective))  # a fresh receive buffer: in place
        return None, grad


def _contiguous(grad: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
    """`grad.contiguous()`, into a reused buffer when a copy is needed (an expanded gradient,
    e.g. of a sum, arrives with stride 0)."""
    if grad.is_contiguous():
        return grad
    name = exchange.collective.name + "_grad"
    flat = buffers.take(name, grad.numel(), grad.dtype, grad.device)
    return flat.view(grad.shape).copy_(grad)


class _Finish(Function):
    """token -> output: waits for the forward collective; backward issues the transpose."""

    @staticmethod
    def forward(ctx, exchange: _Exchange, token: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.exchange = exchange
        pending, exchange.pending = exchange.pending, None
        return pending.wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        exchange: _Exchange = ctx.exchange
        collective = exchange.collective
        pending = collective.backward_dividing(grad, _divisor(collective))
        exchange.divided_before_send = pending is not None
        if pending is None:
            pending = collective.backward(_contiguous(grad, exchange))
        exchange.grad_pending = pending
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
        post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.collective = collective
        self._post = post
        self._exchange = _Exchange(collective)
        self._token = _Issue.apply(self._exchange, x.contiguous())

    def _wait_impl(self) -> torch.Tensor:
        out = _Finish.apply(self._exchange, self._token)
        self._token = None
        return out if self._post is None else self._post(out)


def backward_wait_nodes(tensors: Sequence[torch.Tensor]) -> List[torch.autograd.graph.Node]:
    """The autograd nodes behind `tensors` that wait for a collective's backward transpose.

    Each one runs after the node above it has issued the transposed collective; a pre-hook on
    it runs while that collective is on the wire (the semi-sync pipeline issues its next
    input dist there, so it queues behind the gradients). The walk stops at those nodes: what
    lies below them is local compute.
    """
    found: List[torch.autograd.graph.Node] = []
    seen = set()
    todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "_forward_cls", None) is _Issue:
            found.append(node)
            continue
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found
