"""One torchrun rank of the sharded-vs-unsharded EBC cases (tests/distributed), on any hosts.

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        tests/cluster/equivalence_worker.py OUT_DIR

Runs `test_sharded_ebc.run_all` for table-, row-, column-, table-row-wise and data-parallel
plans (fused SGD and row-wise Adagrad, dense kernel) with torchrun's LOCAL_WORLD_SIZE as the
host size, and writes this rank's mismatches, host name and launcher variables to
OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import List

_TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TESTS), str(_TESTS / "distributed")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_sharded_ebc import EbcCase, run_all  # noqa: E402

KINDS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]


def cases(local_world_size: int) -> List[EbcCase]:
    """Fused SGD and row-wise Adagrad, the dense kernel, and weighted TWRW, per plan kind."""
    lws = local_world_size
    found = [
        EbcCase(lws, kind, "fused", optimizer, weighted=False, batch_size=3, steps=3)
        for kind in KINDS
        for optimizer in ("sgd", "rowwise_adagrad")
    ]
    found += [
        EbcCase(lws, kind, "dense", "sgd", weighted=False, batch_size=3, steps=2) for kind in KINDS
    ]
    found.append(
        EbcCase(lws, "table_row_wise", "fused", "sgd", weighted=True, batch_size=2, steps=2)
    )
    return found


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    try:
        results = run_all(rank, world_size, cases(local_world_size))
    finally:
        dist.destroy_process_group()
    record = {
        "rank": rank,
        "host": socket.gethostname(),
        "results": results,
        "env": {k: os.environ[k] for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")},
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
