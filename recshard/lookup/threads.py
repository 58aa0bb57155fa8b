"""Run a rank's CPU lookup kernels side by side on torch's threads, forward and backward.

fbgemm's CPU TBE runs a kernel's forward, and its backward with the fused update, on one
thread (the exact optimizers' update loop is serial), so on a rank given several threads
(`torch.set_num_threads`) one big kernel leaves the other cores idle. `GroupedLookup` splits
a fused group into a few kernels per thread; this module runs them concurrently, the caller's
thread and the pool's each taking the next kernel when free, the kernels with the most ids
of this batch first (kernels' tables are cut without knowing pooling factors: the queue
evens out what the cut does not):

- forward: each kernel's lookup is one task;
- backward: `_JoinOutputs` hands each kernel's slice of the output gradient to its own
  `torch.autograd.backward` call, again one task each. Kernels own disjoint tables, so
  the updates neither race nor depend on the order: results equal the serial run exactly.

Only fused kernels go to the pool: their backward touches nothing but their own tables and
optimizer state. Dense kernels stay on the caller's thread, since their weights carry hooks
(data-parallel averaging, DDP) that run collectives, which must keep one order on every rank.
Only the kernels' own graphs are walked on the pool: the join is used only when nothing
upstream of the kernels needs gradients (ids never do; per-sample weights might, and then
the kernels run serially on the caller's thread).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, List, Sequence, Tuple

import torch
from torch import nn

_pool: ThreadPoolExecutor | None = None
_pool_key: Tuple[int, int] = (-1, 0)  # (pid, workers): a forked child builds its own pool


def _executor() -> ThreadPoolExecutor:
    """This process's pool: torch's thread count less the caller's own thread."""
    global _pool, _pool_key
    key = (os.getpid(), max(1, torch.get_num_threads() - 1))
    if _pool is None or _pool_key != key:
        if _pool is not None and _pool_key[0] == key[0]:
            _pool.shutdown(wait=False)
        _pool = ThreadPoolExecutor(key[1], thread_name_prefix="recshard-lookup")
        _pool_key = key
    return _pool


def _fan_out(tasks: Sequence[Callable[[], object]], costs: Sequence[int]) -> List[object]:
    """Run `tasks` on this thread and the pool's, results in task order, first error raised.

    Every thread takes the next task when it is free, costliest first (`costs`: the ids each
    task looks up), so uneven tasks still keep the threads equally busy.
    """
    if not tasks:
        return []
    queue = iter(sorted(range(len(tasks)), key=lambda i: -costs[i]))
    lock = threading.Lock()
    results: List[object] = [None] * len(tasks)

    def drain() -> None:
        while True:
            with lock:
                index = next(queue, None)
            if index is None:
                return
            results[index] = tasks[index]()

    helpers = min(len(tasks), torch.get_num_threads()) - 1
    futures: List[Future] = [_executor().submit(drain) for _ in range(helpers)]
    try:
        drain()
    finally:
        wait(futures)  # never leave a kernel running past an error
    for future in futures:
        future.result()
    return results


class _JoinOutputs(torch.autograd.Function):
    """Hands out the kernels' (detached) outputs; backward runs their graphs in parallel."""

    @staticmethod
    def forward(
        ctx,
        anchor: torch.Tensor,
        outputs: List[torch.Tensor],  # noqa: ANN001
        costs: Sequence[int],
        *detached: torch.Tensor,
    ) -> Tuple[torch.Tensor, ...]:
        ctx.outputs, ctx.costs = outputs, costs
        ctx.set_materialize_grads(False)  # an unused output's kernel gets no backward at all
        return tuple(out.view_as(out) for out in detached)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # noqa: ANN001, ANN205
        outputs, ctx.outputs = ctx.outputs, None
        used = [
            i
            for i, (out, g) in enumerate(zip(outputs, grads))
            if g is not None and out.grad_fn is not None
        ]
        _fan_out(
            [(lambda out=outputs[i], g=grads[i]: torch.autograd.backward(out, g)) for i in used],
            [ctx.costs[i] for i in used],
        )
        return (None, None, None, *([None] * len(outputs)))


def run_side_by_side(
    kernels: Sequence[nn.Module], inputs: Sequence[object], costs: Sequence[int]
) -> List[torch.Tensor]:
    """`[k(x) for k, x in zip(kernels, inputs)]`, kernels on parallel threads, costliest first
    (`costs[i]`: the ids kernel i looks up; forward and backward both follow it).

    Kernels must touch only their own state in backward (fused kernels: no parameter hooks,
    no collectives), and no input may require grad (see the module docstring).
    """
    grad_enabled = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()

    def call(kernel: nn.Module, features: object) -> torch.Tensor:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
            return kernel(features)

    outputs: List[torch.Tensor] = _fan_out(
        [(lambda k=k, x=x: call(k, x)) for k, x in zip(kernels, inputs)], costs
    )
    if not any(out.requires_grad for out in outputs):
        return outputs
    anchor = torch.empty(
        0, requires_grad=True, device=outputs[0].device
    )  # gives the join a node in the outer graph
    return list(_JoinOutputs.apply(anchor, outputs, costs, *(out.detach() for out in outputs)))
