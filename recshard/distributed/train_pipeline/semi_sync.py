"""TrainPipelineSemiSync: batch i+1's embedding lookup and output all-to-all run while batch i's
dense backward runs, so the embeddings each batch trains on are one step stale.

    pipeline = TrainPipelineSemiSync(model, optimizer, device, start_batch=0)
    output = pipeline.progress(it)          # as TrainPipelineSparseDist

Staleness (TorchRec's semi-synchronous training): once a batch's index reaches `start_batch`,
the next batch's embeddings are looked up before this batch's sparse update, i.e. from tables
holding every update up to batch i-1 but not batch i's. Dense weights are not stale (with
`stash_gradients=True` the dense optimizer steps on the previous batch's gradients, stale too).
Before `start_batch` the lookup waits for the update: synchronous training, same as the plain
loop. A test holds the pipeline to a plain loop that applies the same staleness
(`tests/distributed/test_semi_sync.py`).

progress(i), semi-synchronous (batch i's lookup was started a step earlier):

    start batch i+3's input dist (splits exchange); fetch and copy batch i+4
    forward(i)          the sharded modules return batch i's embeddings, detached: the dense
                        backward stops at them
    lookup(i+1)         batch i+1's lookup, then its output all-to-all is issued
    backward(loss_i)    dense gradients (i+1's all-to-all on the wire meanwhile)
    embedding backward  batch i's output-dist backward and fused sparse update; batch i+3's
      (i)               tensors exchange is issued as soon as the gradients' all-to-all is, so
                        on a link that sends in order it queues behind them, not ahead
    optimizer.step()    dense

Each batch's ids are sent two steps before its lookup (TorchRec: one), so on a link-bound step
the link always has the next batches' ids to send while the ranks compute, and no gradient
all-to-all waits behind them. Five batches are in flight (TorchRec: four).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch import nn

from recshard.comm.request import backward_wait_nodes
from recshard.distributed.train_pipeline.pipelines import In, Out, TrainPipelineSparseDist
from recshard.distributed.train_pipeline.utils import (
    EmbeddingTrainPipelineContext,
    PipelinedForward,
    take_routed_input,
    wait_for_batch,
)
from recshard.sparse import JaggedTensor, KeyedTensor
from recshard.types import LazyNoWait

Embeddings = KeyedTensor | Dict[str, JaggedTensor]
# Queue positions (0: the batch this step trains) of the batch whose lookup this step starts,
# and of the batch whose ids this step sends (its tensors exchange).
_LOOKUP_AHEAD = 1
_TENSORS_AHEAD = 3


def _detach(
    embeddings: Embeddings, name: str
) -> Tuple[Embeddings, List[torch.Tensor], List[torch.Tensor]]:
    """The same embeddings on fresh leaves; and (originals, leaves) to run their backward with."""
    if isinstance(embeddings, KeyedTensor):
        leaf = embeddings.values().detach().requires_grad_()
        detached = KeyedTensor(
            embeddings.keys(), embeddings.length_per_key(), leaf, embeddings.key_dim()
        )
        return detached, [embeddings.values()], [leaf]
    if isinstance(embeddings, dict) and all(
        isinstance(v, JaggedTensor) for v in embeddings.values()
    ):
        out, originals, leaves = {}, [], []
        for key, jt in embeddings.items():
            leaf = jt.values().detach().requires_grad_()
            out[key] = JaggedTensor(leaf, jt.weights_or_none(), offsets=jt.offsets())
            originals.append(jt.values())
            leaves.append(leaf)
        return out, originals, leaves
    raise TypeError(
        f"TrainPipelineSemiSync: sharded module '{name}' returned "
        f"{type(embeddings).__name__}; it can pipeline modules that return a "
        "KeyedTensor or a dict of JaggedTensors"
    )


class EmbeddingPipelinedForward(PipelinedForward):
    """A sharded module's forward under `TrainPipelineSemiSync`: inside the pipeline's forward of
    a batch it returns that batch's embeddings (looked up a step earlier) on detached leaves and
    keeps the originals in the batch's context for the embedding backward."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self._slot.context
        if (
            not isinstance(ctx, EmbeddingTrainPipelineContext)
            or self.name not in ctx.embedding_requests
        ):
            return super().__call__(*args, **kwargs)
        embeddings = ctx.embedding_requests.pop(self.name).wait()
        detached, originals, leaves = _detach(embeddings, self.name)
        ctx.embedding_tensors.append(originals)
        ctx.detached_embedding_tensors.append(leaves)
        return LazyNoWait(detached)


class TrainPipelineSemiSync(TrainPipelineSparseDist[In, Out]):
    """Semi-synchronous training (TorchRec's name and arguments): see the module docstring.

    `start_batch`: the first batch index trained semi-synchronously (TorchRec's default 900: a
    synchronous start). `stash_gradients`: the dense optimizer steps on the previous batch's
    gradients (skipped at `start_batch`, which has none). `custom_model_fwd(batch) -> (loss,
    output)` replaces `model(batch)`. `pipeline_postproc` and
    `dmp_collection_sync_interval_batches` are accepted for TorchRec compatibility; they have no
    effect (recshard pipelines no postproc modules and has no 2D DMP collection).
    """

    _pipelined_forward_type = EmbeddingPipelinedForward
    _output_dist_first = False  # its lookups start a step ahead, on their own schedule
    _context_type = EmbeddingTrainPipelineContext

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        start_batch: int = 900,
        stash_gradients: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[In | None], Tuple[torch.Tensor, Out]] | None = None,
        strict: bool = False,
        dmp_collection_sync_interval_batches: int | None = 1,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            strict=strict,
        )
        self._start_batch = start_batch
        self._stash_gradients = stash_gradients
        self._model_fwd = custom_model_fwd if custom_model_fwd is not None else model
        self._gradients: Dict[str, torch.Tensor] = {}

    def is_semi_sync(self) -> bool:
        """Whether the next `progress` trains semi-synchronously."""
        contexts = self._queue.contexts
        return bool(contexts) and contexts[0].index >= self._start_batch

    # ---------------------------------------------------------------- stages

    def _issue_tensors(self, position: int) -> None:
        """Batch `position`'s tensors exchange, if its splits exchange is still pending."""
        contexts = self._queue.contexts
        if position < len(contexts) and contexts[position].splits_requests:
            self._wait_sparse_data_dist(contexts[position])

    def _start_embedding_lookup(self, position: int, training: bool) -> None:
        """Batch `position`'s lookup and output dist, for every pipelined module (a batch whose
        input was rejected has none: its own step raises)."""
        if position >= len(self._queue.batches):
            return
        batch, context = self._queue.batches[position], self._queue.contexts[position]
        self._issue_tensors(position)
        if context.input_error is not None or context.lookup_started:
            return
        context.lookup_started = True
        wait_for_batch(batch, self._data_dist_stream)
        with contextlib.nullcontext() if training else torch.no_grad():
            for spec in self._specs:
                data, module_ctx = take_routed_input(context, spec.name, self._data_dist_stream)
                context.embedding_requests[spec.name] = spec.module.compute_and_output_dist(
                    module_ctx, data
                )

    def _fill(self, dataloader_iter: Iterator[In], training: bool) -> None:
        """Bring the queue to its steady state: the head batch's lookup started, the next
        `_TENSORS_AHEAD - 1` batches' tensors exchanges issued, one more batch fetched."""
        queue = self._queue
        for position in range(_TENSORS_AHEAD):
            if position == len(queue.batches) and not self._enqueue_batch(dataloader_iter):
                break
            if not queue.contexts[position].dist_started and not self._start_sparse_data_dist(
                position
            ):
                break
            self._issue_tensors(position)
            if position == 0:
                self._start_embedding_lookup(0, training)
        else:
            if len(queue.batches) == _TENSORS_AHEAD:
                self._enqueue_batch(dataloader_iter)

    def _embedding_backward(self, context: EmbeddingTrainPipelineContext) -> None:
        """Batch i's backward from its embeddings into the sharded modules (output-dist backward,
        fused sparse update); batch i+3's tensors exchange is issued once the gradients'
        collectives are (or after, where none carries them)."""
        originals, grads = [], []
        for tensors, leaves in zip(context.embedding_tensors, context.detached_embedding_tensors):
            for tensor, leaf in zip(tensors, leaves):
                if leaf.grad is not None and tensor.requires_grad:
                    originals.append(tensor)
                    grads.append(leaf.grad)
        issue = lambda *_: self._issue_tensors(_TENSORS_AHEAD)  # noqa: E731
        handles = [node.register_prehook(issue) for node in backward_wait_nodes(originals)]
        try:
            if originals:
                torch.autograd.backward(originals, grads)
        finally:
            for handle in handles:
                handle.remove()
        issue()

    def _dense_step(self, semi_sync: bool, index: int) -> None:
        if self._optimizer is None:
            return
        if semi_sync and self._stash_gradients:
            for name, param in self._model.named_parameters():
                stashed = self._gradients.pop(name, None)
                if param.grad is not None:
                    self._gradients[name] = param.grad.clone()
                param.grad = stashed
            if index == self._start_batch:
                return  # no gradients stashed yet
        self._optimizer.step()

    # ---------------------------------------------------------------- one step

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        self.attach()
        queue = self._queue
        queue.use(dataloader_iter)
        training = self._run_backward and self._model.training
        self._fill(dataloader_iter, training)
        if not queue.batches:
            raise StopIteration
        batch, context = queue.batches[0], queue.contexts[0]
        if context.input_error is not None:  # rejected, found when its tensors were issued
            queue.pop()
            raise context.input_error
        semi_sync = context.index >= self._start_batch
        if training and self._optimizer is not None:
            self._optimizer.zero_grad()
        if len(queue.batches) > _TENSORS_AHEAD and self._start_sparse_data_dist(_TENSORS_AHEAD):
            self._enqueue_batch(dataloader_iter)  # batch i+4: fetch and copy
        try:
            losses, output = self._forward(batch, context, training)
            if semi_sync:
                self._start_embedding_lookup(_LOOKUP_AHEAD, training)
            if training:
                torch.sum(losses).backward()
                self._embedding_backward(context)
                self._dense_step(semi_sync, context.index)
            else:
                self._issue_tensors(_TENSORS_AHEAD)
            if not semi_sync:
                self._start_embedding_lookup(_LOOKUP_AHEAD, training)
        finally:
            queue.pop()  # a batch that raised is dropped: the next call goes on
        return output
