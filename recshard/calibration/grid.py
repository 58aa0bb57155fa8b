"""What a calibration measures: the kernel, memory and link probes' sizes (`CalibrationGrid`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class CalibrationGrid:
    """What to measure. The default takes about 45 s on one quiet CPU core (kernels within
    `budget_s`, then three memory probes and the links); `quick()` a few s."""

    dims: Tuple[int, ...] = (16, 64, 128)
    poolings: Tuple[int, ...] = (1, 4, 32)
    batches: Tuple[int, ...] = (256, 2048)
    rows: Tuple[int, ...] = (2_000, 100_000)  # a cache-resident and a cold table
    tables: int = 4  # working sets of 100-400 MB, as a rank's tables
    link_bytes: Tuple[int, ...] = (1 << 14, 1 << 18, 1 << 21, 1 << 23)
    # the backend's all-reduce carries data-parallel gradients, MBs each: its rate is timed
    # on gradient-sized calls (`fit_rate`)
    all_reduce_bytes: Tuple[int, ...] = (1 << 23, 1 << 25)
    link_repeats: int = 7
    memory_repeats: int = 3  # fresh processes per step probe of `measure_memory` (median)

    @classmethod
    def quick(cls) -> CalibrationGrid:
        return cls(
            dims=(16, 32),
            poolings=(1, 4),
            batches=(32, 128),
            rows=(200, 2000),
            link_bytes=(1 << 10, 1 << 14, 1 << 16),
            all_reduce_bytes=(1 << 14, 1 << 16),
            link_repeats=3,
            memory_repeats=1,
        )
