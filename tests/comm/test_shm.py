"""The shared-memory all-to-all (recshard.comm.shm, chosen by recshard.comm.transport) across
real processes, against gloo.

Each rank runs the same randomized sequence of all-to-all-v calls twice: on a group that goes
through gloo (made with `RECSHARD_SHM_ALL_TO_ALL=0`) and on one that goes through shared memory;
the bytes must be equal. Sizes include zero and several MB, dtypes and call sites vary, many
calls are in flight at once and some are never waited. A cap smaller than one call streams the
call through in pieces, and the memory a rank holds never exceeds the cap.
"""

from __future__ import annotations

import os
import random
from typing import List, Tuple

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from recshard.comm import shm, transport
from recshard.comm.request import issue_all_gather, issue_all_to_all, issue_reduce_scatter

_DTYPES = [torch.float32, torch.int64, torch.float16, torch.int32, torch.bfloat16, torch.uint8]
_SITES = ["alltoall_pooled", "kjt_all_to_all_values", "alltoall_sequence", "alltoallv"]


def _script(seed: int, ws: int, calls: int, big: int) -> List[dict]:
    """The same random sequence of calls on every rank: per call a site, a dtype, the sizes
    every rank sends every rank (zero often, up to `big` elements), how many calls to issue
    before waiting, and whether this call is never waited."""
    rng = random.Random(seed)
    out = []
    for _ in range(calls):
        scale = rng.choice([0, 1, 37, 1000, big])
        sizes = [
            [rng.choice([0, scale, rng.randrange(scale + 1)]) for _ in range(ws)] for _ in range(ws)
        ]
        out.append(
            dict(
                site=rng.choice(_SITES),
                dtype=rng.choice(_DTYPES),
                sizes=sizes,
                batch=rng.choice([1, 1, 2, 5, 9]),
                dropped=rng.random() < 0.15,
                kind=rng.choice(["a2a", "a2a", "a2a", "rs", "ag"]),
            )
        )
    return out


def _run(rank: int, ws: int, pg: dist.ProcessGroup, script: List[dict]) -> List[torch.Tensor]:
    """Issue the script's calls on `pg`, `batch` at a time, and return what the waited ones
    received (bytes)."""
    results: List[torch.Tensor] = []
    pending: List[Tuple[object, bool]] = []
    for i, call in enumerate(script):
        ins = call["sizes"][rank]
        outs = [call["sizes"][s][rank] for s in range(ws)]
        g = torch.Generator().manual_seed(7919 * i + rank)
        x = torch.randint(0, 250, (sum(ins),), generator=g).to(call["dtype"])
        if call["kind"] == "rs" and call["dtype"] in (torch.float32, torch.int64):
            same = [call["sizes"][0][r] for r in range(ws)]  # every rank cuts alike
            y = torch.randint(0, 250, (sum(same),), generator=g).to(call["dtype"])
            p = issue_reduce_scatter(y, same, pg, name=call["site"] + "_rs")
        elif call["kind"] == "ag":
            sizes = [call["sizes"][s][0] for s in range(ws)]
            p = issue_all_gather(x[: sizes[rank]], sizes, pg, name=call["site"] + "_ag")
        else:
            p = issue_all_to_all(x, ins, outs, pg, name=call["site"])
        pending.append((p, call["dropped"]))
        if len(pending) >= call["batch"] or i == len(script) - 1:
            for p, dropped in pending:
                if not dropped:
                    got = p.wait()
                    results.append(got.view(-1).clone().view(torch.uint8))
            pending = []
    return results


def _compare(rank: int, ws: int, seed: int, calls: int, big: int) -> Tuple[bool, bool, bool, int]:
    script = _script(seed, ws, calls, big)
    os.environ[transport.ENV] = "0"
    gloo_pg = dist.new_group(list(range(ws)), backend="gloo")
    expected = _run(rank, ws, gloo_pg, script)
    os.environ[transport.ENV] = "1"
    got = _run(rank, ws, dist.group.WORLD, script)
    same = len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    used = transport.uses_shared_memory(dist.group.WORLD)
    return same, not transport.uses_shared_memory(gloo_pg), used, len(got)


@pytest.mark.parametrize("world_size,seed", [(2, 1), (3, 2), (4, 3)])
def test_randomized_calls_are_bit_identical_to_gloo(world_size: int, seed: int) -> None:
    results = run_ranks(world_size, _compare, seed, 40, 1 << 19, timeout=120)
    for rank, (same, gloo_off, shm_on, n) in enumerate(results):
        assert gloo_off and shm_on, f"rank {rank}: switch {gloo_off}, shared memory {shm_on}"
        assert same and n > 0, f"rank {rank}: shared-memory collectives differ from gloo's"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("cap_mb", ["64", "0.25"])
def test_long_randomized_stress_is_bit_identical_to_gloo(world_size: int, cap_mb: str) -> None:
    for seed in range(3):
        results = run_ranks(
            world_size,
            _compare,
            100 + seed,
            300,
            1 << 21,
            timeout=600,
            env={transport.CAP_ENV: cap_mb},
        )
        assert all(r[0] and r[2] for r in results), (seed, [r[:3] for r in results])


def test_a_cap_smaller_than_one_call_streams_it_in_pieces() -> None:
    """64 KiB of shared memory per rank carries calls of several MB, bit-identical to gloo."""
    results = run_ranks(3, _compare, 5, 25, 1 << 20, timeout=120, env={transport.CAP_ENV: "0.0625"})
    for rank, (same, _, shm_on, _) in enumerate(results):
        assert shm_on and same, f"rank {rank}"


def _memfd_mapped() -> Tuple[int, int]:
    """Bytes of this process's mappings of its own / its peers' transport segments."""
    own = peers = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:recshard" in line:
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                if line.split()[1].startswith("rw"):
                    own += hi - lo
                else:
                    peers += hi - lo
    return own, peers


def _burst(rank: int, ws: int, cap: int) -> Tuple[List[int], List[int], int, bool]:
    """16 calls of 2 MiB per peer in flight at once, then a small one: what the rank holds."""
    held, mapped = [], []
    pendings = []
    for k in range(16):
        x = torch.full((ws * (1 << 19),), float(rank * 100 + k))
        pendings.append(issue_all_to_all(x, [1 << 19] * ws, [1 << 19] * ws, dist.group.WORLD))
        held.append(shm.held_bytes(dist.group.WORLD))
        mapped.append(_memfd_mapped()[0])
    ok = all(
        torch.equal(
            p.wait().view(ws, -1),
            torch.tensor([[s * 100.0 + k] for s in range(ws)]).expand(ws, 1 << 19),
        )
        for k, p in enumerate(pendings)
    )
    for _ in range(2 * shm._WINDOW):  # the burst has passed: small calls only
        issue_all_to_all(torch.ones(ws * 16), [16] * ws, [16] * ws, dist.group.WORLD).wait()
    return held, mapped, shm.held_bytes(dist.group.WORLD), ok


def test_memory_stays_under_the_cap_through_a_burst_and_shrinks_after() -> None:
    cap = 8 << 20
    results = run_ranks(2, _burst, cap, timeout=120, env={transport.CAP_ENV: "8"})
    for held, mapped, after, ok in results:
        assert ok
        assert max(held) <= cap and max(mapped) <= cap, (held, mapped)
        assert max(held) > 2 << 20  # it grew for the burst
        assert after <= 1 << 20  # and gave it back


def _switched_off(rank: int, ws: int, off_ranks: List[int]) -> Tuple[bool, List[float]]:
    os.environ[transport.ENV] = "0" if rank in off_ranks else "1"
    x = torch.arange(ws * 3, dtype=torch.float32) + 100 * rank
    got = issue_all_to_all(x, [3] * ws, [3] * ws, dist.group.WORLD, name="alltoallv").wait()
    return not transport.uses_shared_memory(dist.group.WORLD), got.tolist()


@pytest.mark.parametrize("off_ranks", [[0, 1], [1]])
def test_switch_off_on_any_rank_gives_gloo(off_ranks: List[int]) -> None:
    """`RECSHARD_SHM_ALL_TO_ALL=0` on every rank, or on one: all ranks agree on gloo."""
    results = run_ranks(2, _switched_off, off_ranks, timeout=60)
    for rank, (gloo, got) in enumerate(results):
        assert gloo
        assert got == [3 * rank + i + 100 * s for s in range(2) for i in range(3)]


def _bad_cap(rank: int, ws: int) -> str:
    if rank == 1:
        os.environ[transport.CAP_ENV] = "lots"
    try:
        transport.uses_shared_memory(dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_bad_cap_on_one_rank_is_an_error_on_every_rank() -> None:
    for message in run_ranks(2, _bad_cap, timeout=60):
        assert "rank 1" in message and "RECSHARD_SHM_CAP_MB='lots'" in message, message


def _hosts(rank: int, ws: int) -> Tuple[bool, bool, List[float]]:
    """On 2 simulated hosts (LOCAL_WORLD_SIZE=2): the world group spans them, a host's own
    group does not."""
    host = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = host[rank // 2]
    x = torch.arange(ws * 2, dtype=torch.float32) + 100 * rank
    got = issue_all_to_all(x, [2] * ws, [2] * ws, dist.group.WORLD, name="alltoallv").wait()
    y = torch.arange(4, dtype=torch.float32) + 10 * rank
    issue_all_to_all(y, [2, 2], [2, 2], mine, name="alltoallv").wait()
    world_backend = not transport.uses_shared_memory(dist.group.WORLD)
    return world_backend, transport.uses_shared_memory(mine), got.tolist()


def test_simulated_hosts_keep_cross_host_traffic_off_shared_memory() -> None:
    """Ranks that simulate hosts on one machine (torchrun's layout via LOCAL_WORLD_SIZE) take
    the backend across "hosts", as real hosts must, and shared memory inside one."""
    results = run_ranks(4, _hosts, timeout=120, env={"LOCAL_WORLD_SIZE": "2"})
    for rank, (world_backend, host_shm, got) in enumerate(results):
        assert world_backend and host_shm, f"rank {rank}: {world_backend}, {host_shm}"
        assert got == [2 * rank + i + 100 * s for s in range(4) for i in range(2)]
