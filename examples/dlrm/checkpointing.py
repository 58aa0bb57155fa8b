"""Checkpoints a restarted DLRM job resumes from without losing or changing a step.

A checkpoint (`recshard.checkpoint.save`) holds the sharded tables, the dense weights, the
fused and dense optimizer state, and in its `extra` the `Progress`: the step counter (which
is also the data position: batch `i` of every stream is fixed by the seed), the eval history,
and each rank's per-step losses and RNG state. `resume` loads the newest complete one, so a
job killed at any point and started again (by hand or by `torchrun --max-restarts`) trains
exactly as the uninterrupted job would have: same batches, same updates, same numbers.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from recshard.checkpoint import load, save
from recshard.distributed import DistributedModelParallel
from recshard.optim import CombinedOptimizer


@dataclass
class Progress:
    """Where training stands on this rank: steps done, evals so far, this rank's losses."""

    step: int = 0
    evals: List[Dict[str, Any]] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _rng_state(device: torch.device) -> Dict[str, str]:
    """This rank's generators: torch's CPU one, and its GPU's when it runs on one."""
    state = {"cpu": _encode(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda"] = _encode(torch.cuda.get_rng_state(device))
    return state


def _set_rng_state(state: Dict[str, str], device: torch.device) -> None:
    torch.set_rng_state(_decode(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_decode(state["cuda"]), device)


def _gather(value: Any) -> List[Any]:
    """Every rank's `value`, in rank order (collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def save_progress(
    directory: str,
    dmp: DistributedModelParallel,
    optimizer: CombinedOptimizer,
    progress: Progress,
    device: torch.device,
) -> None:
    """Checkpoint the model, both optimizers and `progress` (collective: every rank calls it)."""
    per_rank = _gather({"losses": progress.losses, "rng": _rng_state(device)})
    save(
        directory,
        dmp,
        optimizer,
        {
            "step": progress.step,
            "evals": progress.evals,
            "losses": [r["losses"] for r in per_rank],
            "rng": [r["rng"] for r in per_rank],
        },
    )


def resume(
    directory: str,
    dmp: DistributedModelParallel,
    optimizer: CombinedOptimizer,
    device: torch.device,
    say: Callable[[str], None],
) -> Progress | None:
    """Load the newest complete checkpoint under `directory` into `dmp` and `optimizer`, and
    restore this rank's RNG state; None when there is none yet. A checkpoint from another
    world size loads too (resharded), but the ranks' loss histories and RNG streams cannot
    be mapped onto the new ranks: they start afresh, and the job says so."""
    try:
        extra = load(directory, dmp, optimizer)
    except FileNotFoundError:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    progress = Progress(int(extra["step"]), list(extra.get("evals", [])))
    saved_ranks = len(extra.get("rng", []))
    if saved_ranks == world_size:
        progress.losses = [float(v) for v in extra["losses"][rank]]
        _set_rng_state(extra["rng"][rank], device)
    else:
        say(
            f"notice: the checkpoint in {directory} comes from "
            f"{saved_ranks or 'an unknown number of'}"
            f" rank(s), this job has {world_size}: tables and optimizer state are resharded, "
            f"per-rank losses and RNG streams start afresh"
        )
    return progress
