"""Memory held back on every rank before tables are placed (`StorageReservation`), and what
is left for them (`Capacity`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from recshard.planner.cost.estimators import table_workload
from recshard.planner.planner_types import GIB, PlannerError, TableMeta, Topology


@dataclass
class Capacity:
    """Per-rank memory left for tables after the reservation, and what was reserved."""

    hbm: List[float]
    ddr: List[float]
    dense_bytes: float
    kjt_bytes: float
    fraction: float
    local_world_size: int
    transport_bytes: float = 0.0

    def reserved(self) -> str:
        """What was held back per rank, for messages."""
        transport = (
            f"transport {self.transport_bytes / GIB:.3f} GiB, " if self.transport_bytes else ""
        )
        return (
            f"dense {self.dense_bytes / GIB:.3f} GiB, KJT {self.kjt_bytes / GIB:.3f} GiB, "
            f"{transport}{self.fraction:.0%}"
        )


class StorageReservation:
    """Memory held back on every rank before any table is placed, as explicit numbers.

    `dense_bytes`: the dense model per rank (weights, gradients, optimizer state, DDP
    buckets). None: 4 x the bytes of the module's non-embedding parameters (weight + grad +
    two Adam states); 0 when planning from metadata alone (the CLI).
    `kjt_bytes`: input batches in flight per rank. None: 3 batches (pipeline depth) x
    (12 bytes per id + 4 per bag) summed over all tables' features at the planner batch size.
    `fraction`: a share of each rank's capacity held back (allocator slack); default 0.
    Reservations come out of HBM on cuda and DDR on cpu; on cpu the intra-host transport's
    byte cap (`Topology.transport_bytes_per_rank`) is held back too.
    """

    def __init__(
        self,
        dense_bytes: float | None = None,
        kjt_bytes: float | None = None,
        fraction: float = 0.0,
    ) -> None:
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"reservation fraction must be in [0, 1), got {fraction}")
        self.dense_bytes = dense_bytes
        self.kjt_bytes = kjt_bytes
        self.fraction = fraction

    def reserve(
        self,
        topology: Topology,
        tables: Sequence[TableMeta],
        batch_size: int,
        dense_param_bytes: float = 0.0,
    ) -> Capacity:
        """Per-rank capacity left for tables; PlannerError if the reservation alone is too big."""
        dense = 4.0 * dense_param_bytes if self.dense_bytes is None else float(self.dense_bytes)
        if self.kjt_bytes is None:
            kjt = 0.0
            for table in tables:
                ids, bags = table_workload(table, batch_size)
                kjt += 3 * (12 * ids + 4 * bags)
        else:
            kjt = float(self.kjt_bytes)
        world = topology.world_size
        on_hbm = topology.compute_device == "cuda"
        transport = topology.transport_bytes_per_rank
        hbm = topology.hbm_cap * (1 - self.fraction) - (dense + kjt if on_hbm else 0.0)
        ddr = topology.ddr_cap * (1 - self.fraction) - (0.0 if on_hbm else dense + kjt + transport)
        if hbm < 0 or ddr < 0:
            kind = "HBM" if on_hbm else "DDR"
            cap = topology.hbm_cap if on_hbm else topology.ddr_cap
            shared = f"transport {transport / GIB:.3f} GiB + " if transport else ""
            raise PlannerError(
                f"the storage reservation alone does not fit: dense {dense / GIB:.3f} GiB + "
                f"KJT {kjt / GIB:.3f} GiB + {shared}{self.fraction:.0%} of {cap / GIB:.3f} GiB "
                f"{kind} per rank; lower the batch size or the reservation, or add memory"
            )
        return Capacity(
            [hbm] * world,
            [ddr] * world,
            dense,
            kjt,
            self.fraction,
            topology.local_world_size,
            transport,
        )
