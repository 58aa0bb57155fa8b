"""Run a rank's CPU lookup kernels side by side on torch's threads, forward and backward.

fbgemm's CPU TBE runs a kernel's forward, and its backward with the fused update, on one
thread (the exact optimizers' update loop is serial), so on a rank given several threads
(`torch.set_num_threads`) one big kernel leaves the other cores idle. `GroupedLookup` splits
a fused group into one kernel per thread; this module runs them concurrently:

- forward: every kernel but the first on a pool thread, the first on the caller's;
- backward: `_JoinOutputs` hands each kernel's slice of the output gradient to its own
  `torch.autograd.backward` call, again one per thread. Kernels own disjoint tables, so
  the updates neither race nor depend on the order: results equal the serial run exactly.

Only the kernels' own graphs are walked on the pool: the join is used only when nothing
upstream of the kernels needs gradients (ids never do; per-sample weights might, and then
the kernels run serially on the caller's thread).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

_pool: Optional[ThreadPoolExecutor] = None
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


def _fan_out(tasks: Sequence[Callable[[], object]]) -> List[object]:
    """Run `tasks[1:]` on the pool and `tasks[0]` here; results in order, first error raised."""
    if not tasks:
        return []
    futures: List[Future] = [_executor().submit(task) for task in tasks[1:]]
    try:
        first = tasks[0]()
    finally:
        wait(futures)  # never leave a kernel running past an error
    return [first, *(future.result() for future in futures)]


class _JoinOutputs(torch.autograd.Function):
    """Concatenate the kernels' (detached) outputs; backward runs their graphs in parallel."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, dim: int, outputs: List[torch.Tensor],  # noqa: ANN001
                *detached: torch.Tensor) -> torch.Tensor:
        ctx.outputs, ctx.dim = outputs, dim
        return torch.cat(detached, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        outputs, ctx.outputs = ctx.outputs, None
        grads = grad.split([out.size(ctx.dim) for out in outputs], dim=ctx.dim)
        _fan_out([
            (lambda out=out, g=g: torch.autograd.backward(out, g))
            for out, g in zip(outputs, grads) if out.grad_fn is not None
        ])
        return (None, None, None, *([None] * len(outputs)))


def run_side_by_side(kernels: Sequence[nn.Module], inputs: Sequence[object], dim: int) -> torch.Tensor:
    """`torch.cat([k(x) for k, x in zip(kernels, inputs)], dim)`, kernels on parallel threads.

    The caller must ensure no input requires grad (see the module docstring).
    """
    grad_enabled = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()

    def call(kernel: nn.Module, features: object) -> torch.Tensor:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
            return kernel(features)

    outputs: List[torch.Tensor] = _fan_out([
        (lambda k=k, x=x: call(k, x)) for k, x in zip(kernels, inputs)
    ])
    if not any(out.requires_grad for out in outputs):
        return torch.cat(outputs, dim=dim)
    anchor = torch.empty(0, requires_grad=True)  # gives the join a node in the outer graph
    return _JoinOutputs.apply(anchor, dim, outputs, *(out.detach() for out in outputs))
