"""What the train pipelines share: per-batch contexts, streams, the pipelined forward, and the
per-batch vote that every rank still has data.

Streams: on CUDA the host-to-device copy runs on a `memcpy` stream and the input dist on a
`data_dist` stream; every hand-over between streams is a `wait_stream` plus `record_stream` on
what crosses it (the batch, the routed KJTs, the module contexts). On CPU the streams are `None`,
the stream helpers do nothing, and the same code runs: the overlap there comes from gloo, whose
`async_op=True` collectives run on its own worker threads while the main thread computes.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, ContextManager, Dict, List, Tuple

import torch
import torch.distributed as dist

from recshard.comm.pg import pg_timeout
from recshard.comm.request import wait_work
from recshard.types import Awaitable, FnAwaitable, NoWait, ShardedModule

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- streams


def new_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A high-priority side stream on CUDA; None elsewhere (work then runs in order)."""
    return torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None


def stream_context(stream: torch.cuda.Stream | None) -> ContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record_stream(obj: Any, stream: torch.cuda.Stream) -> None:
    """Mark every CUDA tensor in `obj` (tensor, Pipelineable, dict / list / tuple of them) as
    used on `stream`, so the caching allocator does not reuse it while `stream` still reads it."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, dict):
        for value in obj.values():
            record_stream(value, stream)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            record_stream(value, stream)
    elif hasattr(obj, "record_stream") and not isinstance(obj, Awaitable):
        obj.record_stream(stream)


def wait_for_batch(batch: Any, stream: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for `stream` (which produced `batch`) and record
    `batch` on it."""
    if stream is None:
        return
    current = torch.cuda.current_stream(stream.device)
    current.wait_stream(stream)
    record_stream(batch, current)


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """`batch.to(device, non_blocking=...)`; the batch must be Pipelineable (or a tensor)."""
    if not hasattr(batch, "to"):
        raise TypeError(
            f"the train pipeline needs batches with a `to(device, non_blocking)` method "
            f"(recshard.types.Pipelineable); got {type(batch).__name__}"
        )
    return batch.to(device, non_blocking=non_blocking)


# ----------------------------------------------------------------------------- contexts


@dataclass
class TrainPipelineContext:
    """One batch in flight: each pipelined module's context and its input dist.

    `splits_requests[name]`: the input dist as `input_dist` returned it (splits exchange in
    flight); `tensors_requests[name]`: after the first wait (tensors exchange in flight), consumed
    by the module's pipelined forward. `has_batch`: every rank's vote that it has this batch.
    `dist_started`: its input dist was started; `input_error`: what its input dist raised
    (a rejected batch), raised by the step of this batch instead of the step before it.
    `output_requests[name]`: the module's lookup done and output dist in flight, started before
    the model's forward; its pipelined forward returns it.
    """

    index: int
    has_batch: Awaitable[bool] = field(default_factory=lambda: NoWait(True))
    module_contexts: Dict[str, Any] = field(default_factory=dict)
    splits_requests: Dict[str, Awaitable[Awaitable[Any]]] = field(default_factory=dict)
    tensors_requests: Dict[str, Awaitable[Any]] = field(default_factory=dict)
    output_requests: Dict[str, Any] = field(default_factory=dict)
    dist_started: bool = False
    input_error: Exception | None = None

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        record_stream(self.module_contexts, stream)


@dataclass
class EmbeddingTrainPipelineContext(TrainPipelineContext):
    """A batch in `TrainPipelineSemiSync`: its embedding lookups in flight, then what they gave.

    `embedding_requests[name]`: module `name`'s `compute_and_output_dist` (lookup done, output
    dist in flight). After the batch's forward: `embedding_tensors` (the embeddings, joined to
    the lookup's autograd graph) and `detached_embedding_tensors` (the leaves the dense model
    used, which collect the gradients for the embedding backward), one list entry per module.
    """

    embedding_requests: Dict[str, Any] = field(default_factory=dict)
    embedding_tensors: List[List[torch.Tensor]] = field(default_factory=list)
    detached_embedding_tensors: List[List[torch.Tensor]] = field(default_factory=list)
    lookup_started: bool = False


class ForwardSlot:
    """Which batch's forward the pipeline is running now (None outside the pipeline)."""

    def __init__(self) -> None:
        self.context: TrainPipelineContext | None = None


class PipelinedForward:
    """Replaces a sharded module's `forward` while a pipeline feeds it.

    Inside the pipeline's forward of batch i it ignores the arguments (the same batch fields,
    already routed) and returns batch i's output dist if the pipeline started it before the
    forward; else it takes batch i's input dist, started a step earlier: it waits for the
    tensors exchange on the data-dist stream, hands the result to the current stream, and runs
    `compute_and_output_dist`. Called anywhere else (a plain `model(batch)` outside the pipeline,
    or a second call in one forward) it runs the module's ordinary forward.
    """

    def __init__(
        self, name: str, module: ShardedModule, slot: ForwardSlot, stream: torch.cuda.Stream | None
    ) -> None:
        self._name = name
        self._module = module
        self._slot = slot
        self._stream = stream

    @property
    def name(self) -> str:
        return self._name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self._slot.context
        if ctx is not None and self._name in ctx.output_requests:
            return ctx.output_requests.pop(self._name)
        if ctx is None or (
            self._name not in ctx.tensors_requests and self._name not in ctx.splits_requests
        ):
            return type(self._module).forward(self._module, *args, **kwargs)
        data, module_ctx = take_routed_input(ctx, self._name, self._stream)
        return self._module.compute_and_output_dist(module_ctx, data)


def take_routed_input(
    ctx: TrainPipelineContext, name: str, stream: torch.cuda.Stream | None
) -> Tuple[Any, Any]:
    """Finish module `name`'s input dist of one batch (waiting on the data-dist `stream`) and
    hand what it routed, with the module's context, to the current stream."""
    with stream_context(stream):
        if name in ctx.splits_requests:  # its tensors exchange was not started yet
            ctx.tensors_requests[name] = ctx.splits_requests.pop(name).wait()
        data = ctx.tensors_requests.pop(name).wait()
    module_ctx = ctx.module_contexts[name]
    if stream is not None:
        current = torch.cuda.current_stream(stream.device)
        current.wait_stream(stream)
        record_stream(data, current)
        record_stream(module_ctx, current)
    return data, module_ctx


# ----------------------------------------------------------------------------- uneven data


_GLOO_TWINS: Dict[dist.ProcessGroup, dist.ProcessGroup] = {}


def gloo_twin(pg: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over the ranks of `pg`, made once per group. `new_group` is collective over
    the default group: every rank builds its pipelines in the same order, so they all get here."""
    if pg not in _GLOO_TWINS:
        _GLOO_TWINS[pg] = dist.new_group(
            ranks=dist.get_process_group_ranks(pg), backend="gloo", timeout=pg_timeout(pg)
        )
    return _GLOO_TWINS[pg]


class BatchVote:
    """Every rank says, for each batch it fetches, whether it got one; a batch runs only if all did.

    One all-reduce (MIN) of a one-element int tensor per fetched batch, issued without waiting
    when the batch is fetched and read when its input dist is about to start (a step later), so
    its latency hides behind a step. Without it a rank whose data ends first leaves the others
    hanging in the next all-to-all (TorchRec issues #1014, #3132). The flag is a host value: on
    a non-gloo group (NCCL) the vote runs on a gloo twin of the group, so that reading it never
    synchronizes a CUDA stream.
    """

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self._pg: dist.ProcessGroup | None = None
        if not (dist.is_available() and dist.is_initialized()):
            return
        pg = pg if pg is not None else dist.group.WORLD
        if dist.get_world_size(pg) == 1:
            return
        if dist.get_backend(pg) != "gloo":
            pg = gloo_twin(pg)
        self._pg = pg

    def ask(self, has_batch: bool) -> Awaitable[bool]:
        if self._pg is None:
            return NoWait(has_batch)
        flag = torch.tensor([int(has_batch)], dtype=torch.int32, device="cpu")  # a gloo group
        work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._pg, async_op=True)

        def verdict() -> bool:
            wait_work(work, "pipeline has-batch vote", op="all_reduce", pg=self._pg)
            return bool(flag.item())

        return FnAwaitable(verdict)
