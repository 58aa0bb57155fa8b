"""Per-rank fixed memory of a sharded training step, measured (CPU, Linux).

A sharded module's first steps grow a process's resident memory by a roughly fixed amount
whatever its tables: the code pages of the kernels, autograd and collectives first touched,
the autograd engine's and gloo's threads and buffers, the allocator's first arenas (about
10-12 MB per rank on the development machine, 2 gloo ranks). `measure_rank_overhead` measures
it in fresh processes (one already warmed hides it) that have imported recshard and fbgemm_gpu,
as a job's ranks have: a two-rank gloo group on this host, a sharded module of tiny tables, three
training steps, the peak resident growth from before the build (the median over ranks and runs).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import subprocess
import sys

import torch
import torch.distributed as dist

from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.modules.embedding_configs import EmbeddingBagConfig
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.planner.calibrate import peak_bytes, reset_peak
from recshard.planner.planner import EmbeddingShardingPlanner
from recshard.planner.planner_types import Topology
from recshard.sparse import KeyedJaggedTensor
from recshard.types import ShardingEnv

logger = logging.getLogger(__name__)

PROBE_RUNS = 1  # fresh process groups (seconds each: imports); the median over them and ranks
PROBE_STEPS = 3
PROBE_RANKS = 2


def rank_overhead_probe(port: int, rank: int) -> str:
    """In a fresh process, rank `rank` of a `PROBE_RANKS`-rank gloo group on this host: the
    peak resident growth (bytes) of building a sharded module of one tiny table per rank and
    training it `PROBE_STEPS` steps, as JSON."""
    store = dist.TCPStore("127.0.0.1", port, PROBE_RANKS, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=PROBE_RANKS)
    configs = [
        EmbeddingBagConfig(num_embeddings=8, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(PROBE_RANKS)
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [c.feature_names[0] for c in configs],
        torch.arange(4 * PROBE_RANKS),
        torch.ones(4 * PROBE_RANKS, dtype=torch.int32),
        stride=4,
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.01}
    )
    plan = EmbeddingShardingPlanner(Topology(PROBE_RANKS), 4, debug=False).plan(
        EmbeddingBagCollection(configs, device="meta"), [sharder]
    )
    before = reset_peak()
    ebc = EmbeddingBagCollection(configs, device="meta")
    module = sharder.shard(ebc, plan.plan[""], ShardingEnv.from_process_group(dist.group.WORLD))
    for _ in range(PROBE_STEPS):
        module(kjt).values().sum().backward()
    growth = peak_bytes() - before
    dist.destroy_process_group()
    return json.dumps(growth)


def measure_rank_overhead() -> float | None:
    """The median of `PROBE_RUNS` fresh-process `rank_overhead_probe`s (bytes); None where it
    cannot be measured (not Linux, /proc not writable)."""
    runs = []
    for _ in range(PROBE_RUNS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import recshard, fbgemm_gpu; "
                    "from recshard.distributed.calibrate_memory import rank_overhead_probe; "
                    f"print(rank_overhead_probe({port}, {rank}))",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            for rank in range(PROBE_RANKS)
        ]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                logger.warning("per-rank memory overhead not measured: %s", err.strip()[-500:])
                return None
            runs.append(float(json.loads(out.strip().splitlines()[-1])))
    return statistics.median(runs)
