"""torch.profiler over a few sharded training steps: time per phase (input dist, compute,
output dist, loss, backward, optimizer) and the top ops, as one JSON-ready dict.

`trainee` is any object with `module` (a sharded module: recshard's or TorchRec's, which share
`create_context` / `input_dist` / `compute` / `output_dist`) and `optimizer` (or None). Plain
torch on purpose: `benchmarks/torchrec_ebc.py.txt` profiles TorchRec's step with it too.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch.distributed as dist

_PHASES = ["input_dist", "compute", "output_dist", "loss", "backward", "optimizer"]
# op names of collectives (gloo's record functions, c10d's ops); their self time, summed
_COLLECTIVE_WORDS = (
    "gloo",
    "all_to_all",
    "alltoall",
    "reduce_scatter",
    "all_gather",
    "allgather",
    "barrier",
    "wait",
)


def _phased_step(trainee: Any, kjt: Any) -> None:
    """`train_step` with its phases labelled (ShardedModule.forward spelled out)."""
    from torch.profiler import record_function

    module = trainee.module
    ctx = module.create_context()
    with record_function("input_dist"):
        dist_input = module.input_dist(ctx, kjt).wait().wait()
    with record_function("compute"):
        local = module.compute(ctx, dist_input)
    with record_function("output_dist"):
        pooled = module.output_dist(ctx, local).wait()
    with record_function("loss"):
        loss = pooled.values().sum()
    with record_function("backward"):
        loss.backward()
    if trainee.optimizer is not None:
        with record_function("optimizer"):
            trainee.optimizer.step()
            trainee.optimizer.zero_grad(set_to_none=True)


def profile_steps(
    name: str, trainee: Any, batches: List[Any], steps: int, top: int = 10
) -> Dict[str, object] | None:
    """torch.profiler over `steps` steps on rank 0 (the other ranks run them unprofiled):
    phase times, the collectives' self time, then the `top` ops by self CPU time, per step.
    None on other ranks."""
    from torch.profiler import ProfilerActivity, profile

    if dist.get_rank() != 0:
        for i in range(steps):
            _phased_step(trainee, batches[i % len(batches)])
        return None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            _phased_step(trainee, batches[i % len(batches)])
        wall_us = 1e6 * (time.perf_counter() - start)
    events = prof.key_averages()
    phases = {e.key: e for e in events if e.key in _PHASES}
    ops = sorted(
        (e for e in events if e.key not in _PHASES),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    per_step_ms = 1e-3 / steps
    return dict(
        bench="profile",
        name=name,
        rank=0,
        steps=steps,
        step_ms=round(wall_us * per_step_ms, 2),
        phases_ms={
            k: round(phases[k].cpu_time_total * per_step_ms, 2) for k in _PHASES if k in phases
        },
        phases_untraced_ms={
            k: round(phases[k].self_cpu_time_total * per_step_ms, 2) for k in _PHASES if k in phases
        },
        collectives_self_ms={
            e.key: round(e.self_cpu_time_total * per_step_ms, 2)
            for e in ops
            if any(w in e.key.lower() for w in _COLLECTIVE_WORDS)
            and e.self_cpu_time_total * per_step_ms >= 0.05
        },
        top_ops=[
            dict(
                op=e.key,
                self_ms=round(e.self_cpu_time_total * per_step_ms, 2),
                self_pct=round(100 * e.self_cpu_time_total / wall_us, 1),
                total_ms=round(e.cpu_time_total * per_step_ms, 2),
                calls=round(e.count / steps, 1),
            )
            for e in ops[:top]
        ],
    )
