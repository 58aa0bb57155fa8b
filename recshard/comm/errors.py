"""Errors of embedding collectives, named as people say them.

A backend error (gloo/NCCL's RuntimeError, a process-group timeout) becomes a
`CollectiveError` naming the collective and its direction ("pooled all-to-all (backward)
failed on rank 0 of 2 ..."), so a training loop can tell a dead peer from a bug.
"""

from __future__ import annotations

from typing import Tuple

import torch.distributed as dist

# Payload names (`name=` of the issue_* functions, also the keys of `comm_payload_bytes`)
# as people say them in an error message; a `_bwd` suffix is the autograd transpose.
_READABLE = {
    "alltoall_pooled": "pooled all-to-all",
    "variable_batch_alltoall_pooled": "variable-batch pooled all-to-all",
    "alltoall_sequence": "sequence all-to-all",
    "alltoallv": "all-to-all-v",
    "reduce_scatter_pooled": "pooled reduce-scatter",
    "reduce_scatter_v_pooled": "pooled reduce-scatter-v",
    "all_gather_base_pooled": "pooled all-gather",
    "kjt_all_to_all_splits": "KJT all-to-all splits",
    "kjt_all_to_all_values": "KJT all-to-all values",
    "kjt_all_to_all_weights": "KJT all-to-all weights",
}


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a rank died, raised, or is in another collective).

    The message names the collective and direction, e.g. "pooled all-to-all (forward) failed
    on rank 0 of 2 [all_to_all_single]: <the backend's error>"; `collective` and `direction`
    hold them for code that handles the error.
    """

    def __init__(self, message: str, collective: str, direction: str) -> None:
        super().__init__(message)
        self.collective, self.direction = collective, direction


def describe_collective(name: str) -> Tuple[str, str]:
    """`(readable name, "forward" | "backward")` for a payload name such as
    `alltoall_pooled_bwd`."""
    direction = "backward" if name.endswith("_bwd") else "forward"
    base = name[: -len("_bwd")] if direction == "backward" else name
    return _READABLE.get(base, base.replace("_", " ")), direction


def collective_error(
    name: str, op: str, pg: dist.ProcessGroup | None, error: BaseException, stage: str = "failed"
) -> CollectiveError:
    """A `CollectiveError` for `error` raised by collective `name` (backend call `op`)."""
    readable, direction = describe_collective(name)
    where = ""
    if pg is not None and dist.is_initialized():
        try:
            where = f" on rank {dist.get_rank(pg)} of {dist.get_world_size(pg)}"
        except Exception:  # noqa: BLE001 - a broken group must not hide the real error
            where = ""
    text = str(error).strip() or type(error).__name__
    hint = ""
    if "timed out" in text.lower() or "timeout" in text.lower():
        hint = (
            " (the process-group timeout ran out: another rank died, hangs, or waits in a"
            " different collective; the timeout is init_process_group(timeout=...), e.g."
            " recshard.comm.pg.pg_timeout(), which reads RECSHARD_PG_TIMEOUT_S)"
        )
    return CollectiveError(
        f"{readable} ({direction}) {stage}{where} [{op}]: {text}{hint}", readable, direction
    )
