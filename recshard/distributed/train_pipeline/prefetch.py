"""`PrefetchTrainPipelineSparseDist`: `TrainPipelineSparseDist` that also brings batch i+1's
rows of key-value tables into their DRAM caches while batch i runs backward.

    progress(i):  ... forward(i)
                  first wait of i+1's input dist (tensors exchange starts)
                  side thread: finish i+1's input dist, prefetch its rows  | backward(i),
                                                                          | optimizer.step()
                  join the side thread

The prefetch reads rows from storage (the reads release the GIL) while backward computes;
each table's cache takes its lock around every change, so batch i's update and batch i+1's
prefetch never touch the same slot (batch i's slots stay pinned until its update). Tables of
other kernels have nothing to prefetch. A failed prefetch raises from `progress` after the
step (the rows are fetched again by the next forward).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, List

from recshard.distributed.train_pipeline.pipelines import In, Out, TrainPipelineSparseDist
from recshard.distributed.train_pipeline.utils import TrainPipelineContext


class PrefetchTrainPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """TorchRec's name and arguments (`TrainPipelineSparseDist`'s); see the module docstring."""

    @contextlib.contextmanager
    def _during_backward(self, following: TrainPipelineContext | None) -> Iterator[None]:
        if following is None or following.input_error is not None:
            yield
            return
        errors: List[BaseException] = []
        requests = [
            (spec.module, following.tensors_requests[spec.name])
            for spec in self._specs
            if spec.name in following.tensors_requests and hasattr(spec.module, "prefetch")
        ]

        def prefetch() -> None:
            try:
                for module, request in requests:
                    module.prefetch(request.wait())
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                errors.append(e)

        worker = threading.Thread(target=prefetch, name="recshard-prefetch", daemon=True)
        worker.start()
        try:
            yield
        finally:
            worker.join()
        if errors:
            raise errors[0]
