"""TorchRec's `torchrec.distributed.comm` node-layout helpers, with its signatures: where a
rank sits among nodes ("groups" in torchrun's words: one per node, `get_local_size` ranks
each, numbered node-major).

`intra_and_cross_node_pg` is recshard's (`recshard.comm.pg`): it takes the process group and
the node size instead of reading globals, and caches its groups per group.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from recshard.comm.pg import intra_and_cross_node_pg
from recshard.types import get_local_size

logger = logging.getLogger(__name__)

__all__ = [
    "get_group_rank",
    "get_local_rank",
    "get_local_size",
    "get_num_groups",
    "intra_and_cross_node_pg",
]

_LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK",
    "MPI_LOCALRANKID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
)


def _rank(rank: int | None) -> int:
    return dist.get_rank() if rank is None else rank


def get_local_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """This worker's rank on its node: the launcher's LOCAL_RANK (or the MPI equivalents)
    when set and below the node size, else `rank % get_local_size(world_size)`."""
    local_size = get_local_size(world_size)
    for name in _LOCAL_RANK_VARIABLES:
        if os.environ.get(name, "").lstrip("-").isdigit():
            local_rank = int(os.environ[name])
            if 0 <= local_rank < local_size:
                return local_rank
            break
    return _rank(rank) % local_size


def get_group_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """The index of this worker's node (torchrun's GROUP_RANK): `rank // local size`."""
    return _rank(rank) // get_local_size(world_size)


def get_num_groups(world_size: int | None = None) -> int:
    """The number of nodes: `world_size // local size`."""
    if world_size is None:
        world_size = dist.get_world_size()
    return world_size // get_local_size(world_size)
