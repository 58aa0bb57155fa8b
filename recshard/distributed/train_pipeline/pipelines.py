"""Train pipelines: run step i while the next batches are copied and their ids routed.

    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    it = iter(dataloader)
    while True:
        try:
            output = pipeline.progress(it)   # forward, backward, optimizer.step of one batch
        except StopIteration:
            break

The model's forward takes one batch and returns `(loss, output)` (as TorchRec's `DLRMTrain`);
`progress` returns `output`. In `model.eval()` mode (or with `EvalPipelineSparseDist`) a step
is a forward under `torch.no_grad()`, without zero_grad / backward / step.

`TrainPipelineSparseDist` keeps three batches in flight. While batch i runs forward and
backward, batch i+1's input dist is on the wire (its splits exchange during forward, its
tensors exchange during backward) and batch i+2 is being copied to the device:

    progress(i):  zero_grad
                  start input dist of i+1 (splits exchange)   <- pre-started, async
                  fetch + copy batch i+2                        <- memcpy stream
                  lookup(i), output dist(i) started             <- before the model's forward
                  forward(i)  (sharded modules return batch i's output dist, which was on
                               the wire while the dense layers before them ran)
                  first wait of i+1's input dist (tensors exchange starts)
                  backward(i), optimizer.step()

Errors: a step that raises drops its batch; the next `progress` goes on with the next batch.
A batch rejected by the input checks (on any rank: every rank learns it in the splits
exchange) is found during the step before it; that step still trains its own batch and
returns, and the next `progress` raises the rejection (on every rank) and drops the bad batch,
so a training loop can skip it:

    try:
        output = pipeline.progress(it)
    except ValueError / RuntimeError: log it and continue (StopIteration: the end)
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections import deque
from typing import (
    Any,
    Callable,
    ContextManager,
    Deque,
    Dict,
    Generic,
    Iterator,
    List,
    Tuple,
    Type,
    TypeVar,
)

import torch
import torch.distributed as dist
from torch import nn

from recshard.comm.errors import CollectiveError
from recshard.comm.pg import warn_if_default_timeout
from recshard.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
from recshard.distributed.train_pipeline.tracing import PipelinedModuleSpec, trace_sharded_inputs
from recshard.distributed.train_pipeline.utils import (
    BatchVote,
    ForwardSlot,
    PipelinedForward,
    TrainPipelineContext,
    new_stream,
    stream_context,
    take_routed_input,
    to_device,
    wait_for_batch,
)
from recshard.types import ShardedModule

logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


class TrainPipeline(abc.ABC, Generic[In, Out]):
    """Runs one training step per `progress` call on batches pulled from `dataloader_iter`;
    raises `StopIteration` when there is nothing left to run."""

    _optimizer: torch.optim.Optimizer | None = None

    @abc.abstractmethod
    def progress(self, dataloader_iter: Iterator[In]) -> Out: ...

    def _backward_and_step(self, losses: torch.Tensor, training: bool) -> None:
        """Backward of the summed losses and the optimizer step (training only)."""
        if training:
            torch.sum(losses).backward()
            if self._optimizer is not None:
                self._optimizer.step()


def _process_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group the model's sharded modules talk on (None: the default group)."""
    if isinstance(model, DistributedModelParallel):
        return model.env.pg
    for module in get_unwrapped_module(model).modules():
        env = getattr(module, "env", None) if isinstance(module, ShardedModule) else None
        if env is not None:
            return env.pg
    return None


def _split_result(result: Any) -> Tuple[Any, Any]:
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(
            "the pipelined model's forward must return (loss, output), as TorchRec's DLRMTrain "
            f"does; got {type(result).__name__}"
        )
    return result[0], result[1]


class _BatchQueue:
    """Batches fetched ahead, each copied to the device and voted on by every rank.

    Lockstep rule: a batch's vote is read (`confirm`) before the next batch is fetched, so every
    rank knows the same `stopped` when it decides whether to fetch, and every rank issues the
    same votes in the same order.
    """

    def __init__(
        self,
        device: torch.device,
        memcpy_stream: torch.cuda.Stream | None,
        vote: BatchVote,
        context_type: Type[TrainPipelineContext] = TrainPipelineContext,
    ) -> None:
        self._device = device
        self._context_type = context_type
        self._memcpy_stream = memcpy_stream
        self._vote = vote
        self.batches: Deque[Any] = deque()
        self.contexts: Deque[TrainPipelineContext] = deque()
        self._iterator: Iterator[Any] | None = None
        self._exhausted = False  # this rank's iterator ended: never call next() on it again
        self.stopped = False  # some rank ran out: fetch nothing more
        self._fetched = 0

    def use(self, iterator: Iterator[Any]) -> None:
        """Start over on a new iterator once the previous one is drained."""
        if iterator is not self._iterator and not self.batches:
            self._iterator, self._exhausted, self.stopped = iterator, False, False

    def fetch(self, iterator: Iterator[Any]) -> bool:
        """Pull the next batch, start its copy to the device and its vote; False once stopped."""
        if self.stopped:
            return False
        batch = None
        if not self._exhausted:
            try:
                batch = next(iterator)
            except StopIteration:
                self._exhausted = True
        vote = self._vote.ask(batch is not None)
        if batch is not None:
            with stream_context(self._memcpy_stream):
                batch = to_device(batch, self._device, non_blocking=True)
        self.batches.append(batch)
        self.contexts.append(self._context_type(index=self._fetched, has_batch=vote))
        self._fetched += 1
        return True

    def confirm(self, position: int) -> bool:
        """Whether every rank has the batch at `position`; if not, drop it and stop."""
        context = self.contexts[position]
        if context.has_batch.wait():
            return True
        assert context is self.contexts[-1], "a batch was fetched before the vote ahead of it"
        batch = self.batches[position]
        del self.batches[position], self.contexts[position]
        self.stopped = True
        if batch is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            logger.warning(
                "rank %d: another rank has run out of data; stopping after %d batches "
                "(this rank's batch %d and any later ones are not run)",
                rank,
                context.index,
                context.index,
            )
        return False

    def pop(self) -> None:
        self.batches.popleft()
        self.contexts.popleft()

    def clear(self) -> None:
        self.batches.clear()
        self.contexts.clear()


class TrainPipelineBase(TrainPipeline[In, Out]):
    """Overlaps only the host-to-device copy of batch i+1 with the step of batch i.

    Every batch runs (the last one too); uneven data across ranks stops every rank at the
    same step, as in `TrainPipelineSparseDist`.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._memcpy_stream = new_stream(self._device)
        self._queue = _BatchQueue(
            self._device, self._memcpy_stream, BatchVote(_process_group(model))
        )
        warn_if_default_timeout(_process_group(model))

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        queue = self._queue
        queue.use(dataloader_iter)
        if not queue.batches:
            queue.fetch(dataloader_iter)
        if not queue.batches or not queue.confirm(0):
            raise StopIteration
        batch = queue.batches[0]
        training = self._model.training
        if training and self._optimizer is not None:
            self._optimizer.zero_grad()
        wait_for_batch(batch, self._memcpy_stream)
        queue.fetch(dataloader_iter)  # batch i+1: its copy overlaps this step
        try:
            with contextlib.nullcontext() if training else torch.no_grad():
                losses, output = _split_result(self._model(batch))
            self._backward_and_step(losses, training)
        finally:
            queue.pop()  # a batch that raised is dropped: the next call goes on
        return output


def _finish_unused_outputs(context: TrainPipelineContext) -> None:
    """Output dists started for modules the forward did not call (or raised before calling):
    finished, so that no collective of the batch is left in flight."""
    while context.output_requests:
        _, request = context.output_requests.popitem()
        request.wait()


class TrainPipelineSparseDist(TrainPipeline[In, Out]):
    """Overlaps the input dist (both all-to-all stages) of batch i+1 and the copy of batch i+2
    with forward / backward / optimizer step of batch i. See the module docstring for the order.

    Sharded modules and where their inputs come from are found by `torch.fx` tracing (see
    `tracing.py`). A sharded module whose input is computed inside the model cannot be fed
    ahead: a warning names it and it runs unpipelined (`strict=True` raises instead).

    `execute_all_batches=True`: after the iterator ends, the batches in flight still run, then
    `StopIteration`. False: `StopIteration` as soon as the iterator ends, dropping them (as
    TorchRec: N batches give N - 2 steps). Ranks whose iterators end at different batches all
    stop at the same step (see `BatchVote`). `apply_jit` is accepted for TorchRec compatibility
    and ignored (TorchScript is deprecated).
    """

    _run_backward = True
    _output_dist_first = True  # see _start_output_dists
    _pipelined_forward_type: Type[PipelinedForward] = PipelinedForward
    _context_type: Type[TrainPipelineContext] = TrainPipelineContext

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        strict: bool = False,
    ) -> None:
        self._model = model
        self._model_fwd: Callable[[Any], Any] = model  # what a step calls on the batch
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._execute_all_batches = execute_all_batches
        if apply_jit:
            logger.warning("TrainPipelineSparseDist: apply_jit=True is ignored (no TorchScript)")
        self._memcpy_stream = new_stream(self._device)
        self._data_dist_stream = new_stream(self._device)
        self._slot = ForwardSlot()
        self._specs, self.unpipelined_modules = self._find_pipelined_modules(strict)
        self._forwards: Dict[str, PipelinedForward] = {
            spec.name: self._pipelined_forward_type(
                spec.name, spec.module, self._slot, self._data_dist_stream
            )
            for spec in self._specs
        }
        self._originals: Dict[str, Any] = {
            spec.name: spec.module.__dict__.get("forward") for spec in self._specs
        }
        self._queue = _BatchQueue(
            self._device, self._memcpy_stream, BatchVote(_process_group(model)), self._context_type
        )
        warn_if_default_timeout(_process_group(model))

    # ---------------------------------------------------------------- model rewrite

    def _find_pipelined_modules(
        self, strict: bool
    ) -> Tuple[List[PipelinedModuleSpec], Dict[str, str]]:
        model = get_unwrapped_module(self._model)
        try:
            found = trace_sharded_inputs(model)
        except RuntimeError as e:
            if strict:
                raise
            logger.warning(
                "%s; no sharded module is pipelined (each runs its input dist inside forward)", e
            )
            return [], {}
        for name, reason in found.unpipelined.items():
            if strict:
                raise ValueError(f"sharded module '{name}' cannot be pipelined: {reason}")
            logger.warning(
                "Module '%s' will NOT be pipelined: %s. It runs its input dist "
                "synchronously inside forward.",
                name,
                reason,
            )
        return found.pipelined, found.unpipelined

    @property
    def pipelined_modules(self) -> List[str]:
        """Paths of the sharded modules whose input dist this pipeline starts ahead of time."""
        return [spec.name for spec in self._specs]

    def attach(self) -> None:
        """Install this pipeline's forwards (done by every `progress`; another pipeline on the
        same model may have installed its own in between)."""
        for spec in self._specs:
            forward = self._forwards[spec.name]
            if spec.module.__dict__.get("forward") is not forward:
                spec.module.forward = forward

    def detach(self) -> None:
        """Give the sharded modules back the forwards they had before this pipeline."""
        for spec in self._specs:
            if spec.module.__dict__.get("forward") is self._forwards[spec.name]:
                original = self._originals[spec.name]
                if original is None:
                    del spec.module.forward
                else:
                    spec.module.forward = original

    # ---------------------------------------------------------------- stages

    def _enqueue_batch(self, dataloader_iter: Iterator[In]) -> bool:
        if not self._queue.fetch(dataloader_iter):
            return False
        if not self._execute_all_batches and not self._queue.confirm(-1):
            self._queue.clear()  # drop the batches in flight
            raise StopIteration
        return True

    def _start_sparse_data_dist(self, position: int) -> bool:
        """Start every pipelined module's input dist (splits exchange) for one batch."""
        if not self._queue.confirm(position):
            return False
        batch, context = self._queue.batches[position], self._queue.contexts[position]
        context.dist_started = True
        with stream_context(self._data_dist_stream):
            wait_for_batch(batch, self._memcpy_stream)
            for spec in self._specs:
                module_context = spec.module.create_context()
                context.module_contexts[spec.name] = module_context
                args, kwargs = spec.inputs(batch)
                context.splits_requests[spec.name] = spec.module.input_dist(
                    module_context, *args, **kwargs
                )
        return True

    def _wait_sparse_data_dist(self, context: TrainPipelineContext) -> None:
        """Finish the splits exchanges and start the tensors exchanges of one batch. A rejected
        batch is kept in `context.input_error` (its own step raises it); every module's exchange
        is still finished, so no collective of it is left in flight."""
        with stream_context(self._data_dist_stream):
            for name, request in list(context.splits_requests.items()):
                try:
                    context.tensors_requests[name] = request.wait()
                except CollectiveError:  # a dead or stuck peer: nothing to go on with
                    raise
                except (ValueError, RuntimeError) as e:  # a rejected input, on any rank
                    context.input_error = context.input_error or e
            context.splits_requests.clear()
            if context.input_error is not None:
                for request in context.tensors_requests.values():
                    request.wait()
                context.tensors_requests.clear()

    def _fill_pipeline(self, dataloader_iter: Iterator[In]) -> None:
        if not self._enqueue_batch(dataloader_iter) or not self._start_sparse_data_dist(0):
            return
        self._wait_sparse_data_dist(self._queue.contexts[0])
        self._enqueue_batch(dataloader_iter)

    def _forward(self, batch: In, context: TrainPipelineContext, training: bool) -> Tuple[Any, Out]:
        self._slot.context = context
        try:
            with contextlib.nullcontext() if training else torch.no_grad():
                if self._output_dist_first:
                    self._start_output_dists(context)
                return _split_result(self._model_fwd(batch))
        finally:
            self._slot.context = None
            _finish_unused_outputs(context)

    def _start_output_dists(self, context: TrainPipelineContext) -> None:
        """Every pipelined module's lookup and output dist of this batch, before the model's
        forward: the output all-to-all is on the wire while the dense layers computed before the
        sharded module run (the same values: the lookup reads the weights the last step left)."""
        for spec in self._specs:
            if spec.name in context.tensors_requests or spec.name in context.splits_requests:
                data, module_ctx = take_routed_input(context, spec.name, self._data_dist_stream)
                context.output_requests[spec.name] = spec.module.compute_and_output_dist(
                    module_ctx, data
                )

    def _during_backward(self, following: TrainPipelineContext | None) -> ContextManager[Any]:
        """What runs beside batch i's backward and optimizer step, given batch i+1's context
        (None at the end): nothing here; `PrefetchTrainPipelineSparseDist` prefetches rows."""
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- one step

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        self.attach()
        queue = self._queue
        queue.use(dataloader_iter)
        if not queue.batches:
            self._fill_pipeline(dataloader_iter)
        if not queue.batches:
            raise StopIteration
        batch, context = queue.batches[0], queue.contexts[0]
        if not context.dist_started:  # the batch before it was dropped (it raised)
            if not self._start_sparse_data_dist(0):
                raise StopIteration
        if context.splits_requests:
            self._wait_sparse_data_dist(context)
        if context.input_error is not None:  # rejected, found during the previous step
            queue.pop()
            raise context.input_error
        training = self._run_backward and self._model.training
        if training and self._optimizer is not None:
            self._optimizer.zero_grad()
        wait_for_batch(batch, self._data_dist_stream)
        if len(queue.batches) >= 2:
            self._start_sparse_data_dist(1)  # batch i+1: splits exchange
        self._enqueue_batch(dataloader_iter)  # batch i+2: fetch and copy
        try:
            losses, output = self._forward(batch, context, training)
            following = queue.contexts[1] if len(queue.batches) >= 2 else None
            if following is not None:
                self._wait_sparse_data_dist(following)  # batch i+1: tensors exchange
            with self._during_backward(following):
                self._backward_and_step(losses, training)
        finally:
            queue.pop()  # a batch that raised is dropped: the next call goes on
        return output


class EvalPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """`TrainPipelineSparseDist` for evaluation: every step is a forward under `torch.no_grad()`
    (no zero_grad, backward or optimizer step, whatever `model.training` says), with batch
    i+1's input dist overlapping batch i's forward."""

    _run_backward = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        device: torch.device | None = None,
        apply_jit: bool = False,
        strict: bool = False,
    ) -> None:
        device = torch.device("cpu") if device is None else device
        super().__init__(
            model, optimizer, device, execute_all_batches=True, apply_jit=apply_jit, strict=strict
        )
