"""What recshard's sharded step would gain if its all-to-alls between two ranks of one host went
through shared memory instead of gloo's loopback TCP. A measurement, not a transport.

    python -m benchmarks.shm_exchange                          # column_wise,table_wise, 3 repeats
    python -m benchmarks.shm_exchange --cases column_wise --repeats 5
    python -m benchmarks.shm_exchange --quick                  # tiny sizes (smoke test)

The workload of `benchmarks/ebc.py` (2 pinned ranks, one torch thread each, 3 warm-up + 30
timed steps, a run's figure the median of the slowest rank's steps). Each case runs twice per
repeat, interleaved: the library as it is (gloo), then with every flat all-to-all that
`recshard.comm.request.issue_all_to_all` carries (the KJT ids + lengths, the pooled embeddings
forward and backward) replaced by `ShmAllToAll`. The splits exchange stays on gloo.

`ShmAllToAll` makes the same copies as gloo's path: the chunk for the peer into this rank's
shared segment, this rank's own chunk into the receive buffer, the peer's chunk out of the
peer's segment; what it leaves out is TCP. It spins on counters in the segments (no timeout,
no error path: fine for this measurement, not for a library), so it needs each rank on a core
of its own. Both runs report a checksum of the rank's table weights after the timed steps: the
values must be equal (the same bytes arrive either way). Every line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import recshard.comm.kjt_all_to_all as kjt_all_to_all
import recshard.comm.ops as comm_ops
from benchmarks.ebc import build, criteo_tables, make_batches, train_step
from benchmarks.ebc_workload import QUICK, Sizes, pooling_factors
from benchmarks.ranks import run_ranks, timed_steps, warm_up
from recshard.comm import buffers
from recshard.comm.request import Pending

_CAPACITY = 96 << 20  # bytes a rank may send to its peer in one all-to-all
_COUNTERS = 16  # bytes after the data: [written, read] sequence numbers (int64)


class ShmAllToAll:
    """Flat all-to-all-v between the two ranks of `pg` through /dev/shm, one segment pair per
    call site (`name`), made at its first call (all ranks call the sites in the same order)."""

    def __init__(self) -> None:
        self._sites: Dict[str, List] = {}
        self._token: Optional[str] = None

    def _site(self, name: str, pg: dist.ProcessGroup) -> List:
        if name not in self._sites:
            if self._token is None:
                token = [os.urandom(4).hex()]
                dist.broadcast_object_list(token, src=0, group=pg)
                self._token = token[0]
            me = dist.get_rank(pg)

            def path(rank: int) -> str:
                return f"/dev/shm/recshard-bench-{self._token}-{name}-{rank}"

            with open(path(me), "wb") as f:
                f.truncate(_CAPACITY + _COUNTERS)
            dist.barrier(group=pg)
            segments = [torch.from_file(path(r), shared=True, size=_CAPACITY + _COUNTERS,
                                        dtype=torch.uint8) for r in (me, 1 - me)]
            dist.barrier(group=pg)
            os.unlink(path(me))
            counters = [s[_CAPACITY:].view(torch.int64) for s in segments]
            self._sites[name] = [segments[0], segments[1], counters[0], counters[1], 0]
        return self._sites[name]

    def __call__(self, x: torch.Tensor, input_splits: List[int], output_splits: List[int],
                 pg: dist.ProcessGroup, codec: object = None, name: str = "all_to_all",
                 read: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Pending:
        if codec is not None or dist.get_world_size(pg) != 2:
            raise ValueError("ShmAllToAll: two ranks, no codec")
        site = self._site(name, pg)
        mine, theirs, my_counters, their_counters = site[:4]
        site[4] += 1
        seq = site[4]
        me = dist.get_rank(pg)
        peer = 1 - me
        wire = x.contiguous()
        size = wire.element_size()
        sent_at = [0, input_splits[0]]
        arrives_at = [0, output_splits[0]]
        _spin_until(their_counters, 1, seq - 1)  # the peer has read what this rank wrote last
        count = input_splits[peer]
        if count * size > _CAPACITY:
            raise ValueError(f"ShmAllToAll({name}): {count * size} bytes > {_CAPACITY}")
        if count:
            mine[:count * size].view(wire.dtype).copy_(wire[sent_at[peer]:sent_at[peer] + count])
        my_counters[0] = seq
        out = buffers.take(name, sum(output_splits), wire.dtype, wire.device)
        out[arrives_at[me]:arrives_at[me] + output_splits[me]].copy_(
            wire[sent_at[me]:sent_at[me] + input_splits[me]])
        _spin_until(their_counters, 0, seq)
        count = output_splits[peer]
        if count:
            out[arrives_at[peer]:arrives_at[peer] + count].copy_(
                theirs[:count * size].view(wire.dtype))
        my_counters[1] = seq
        return Pending([], (lambda: read(out)) if read is not None else (lambda: out), name)


def _spin_until(counters: torch.Tensor, index: int, value: int) -> None:
    while int(counters[index]) < value:
        pass


def run(name: str, sizes: Sizes, args: argparse.Namespace, shm: bool) -> Dict[str, object]:
    """One run on this rank: step seconds and a checksum of its table weights afterwards."""
    if shm:
        exchange = ShmAllToAll()
        comm_ops.issue_all_to_all = exchange
        kjt_all_to_all.issue_all_to_all = exchange
    rank = dist.get_rank()
    tables = criteo_tables(sizes)
    pooling = pooling_factors(len(tables), sizes.max_pooling)
    batches = make_batches(tables, pooling, sizes.batch, seed=1 + rank, count=args.batches)
    trainee = build(name, tables, pooling, sizes.batch, None)
    warm_up(lambda i: train_step(trainee, batches[i % len(batches)]), args.warmup)
    times = timed_steps(lambda i: train_step(trainee, batches[i % len(batches)]), args.steps)
    checksum = sum(float(w.double().sum()) for sharding in trainee.module.shardings.values()
                   for w in sharding.lookup.table_weights())
    return {"times": times, "checksum": checksum}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="column_wise,table_wise")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 steps, 1 repeat")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 3, 1
    rank_args = argparse.Namespace(threads=1, pin=True, timeout=600.0)
    figures: Dict[str, Dict[bool, List[float]]] = {}
    for _ in range(args.repeats):
        for case in args.cases.split(","):
            sums = {}
            for shm in (False, True):
                ranks = run_ranks(2, rank_args, run, case, sizes, args, shm)
                step = statistics.median(max(s) for s in zip(*(r["times"] for r in ranks)))
                figures.setdefault(case, {}).setdefault(shm, []).append(step)
                sums[shm] = [r["checksum"] for r in ranks]
            print(json.dumps(dict(bench="shm_exchange_run", case=case,
                                  gloo_ms=round(1e3 * figures[case][False][-1], 2),
                                  shm_ms=round(1e3 * figures[case][True][-1], 2),
                                  same_weights=sums[False] == sums[True])), flush=True)
    for case, by_mode in figures.items():
        gloo, shm = statistics.median(by_mode[False]), statistics.median(by_mode[True])
        print(json.dumps(dict(bench="shm_exchange", case=case, gloo_step_ms=round(1e3 * gloo, 2),
                              shm_step_ms=round(1e3 * shm, 2), saved_pct=round(100 * (1 - shm / gloo), 1),
                              gloo_repeats_ms=[round(1e3 * m, 2) for m in by_mode[False]],
                              shm_repeats_ms=[round(1e3 * m, 2) for m in by_mode[True]])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
