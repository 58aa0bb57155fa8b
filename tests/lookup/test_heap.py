"""A CPU lookup keeps a step's freed temporaries in glibc's heap (no trim, no mmap under
32 MiB), unless the environment chose glibc's malloc settings itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recshard.lookup import heap

ROOT = Path(__file__).resolve().parents[2]
# Allocates and frees four 12 MiB buffers per "step" (touching every page), as a training
# step's temporaries; prints the page faults of steps 2-5 (step 1 may fault them in once).
PROBE = """
import json, resource, sys, torch
from recshard.lookup import heap
mode = sys.argv[1]
if mode == "heap":
    set_here = heap.keep_step_buffers_in_heap()
elif mode == "lookup":
    from recshard.lookup.grouped import GroupedLookup
    from recshard.lookup.tables import LocalTable
    from recshard.modules import EmbeddingBagConfig, PoolingType
    from recshard.types import EmbeddingComputeKernel
    config = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"])
    table = LocalTable(config, 10, 4, 0, 0, EmbeddingComputeKernel.DENSE, PoolingType.SUM)
    GroupedLookup([table], pooled=True, device=torch.device("cpu"))
    set_here = heap.keep_step_buffers_in_heap()
elif mode == "declined":  # a key-value process: set, then handed back to glibc's defaults
    heap.keep_step_buffers_in_heap()
    heap.leave_heap_to_glibc()
    set_here = heap.keep_step_buffers_in_heap()
else:
    set_here = False
def step():
    bufs = [torch.ones(3 << 20) for _ in range(4)]
    del bufs
step()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
print(json.dumps({"set": set_here, "faults_per_step": faults / 4}))
"""
PAGES_PER_STEP = 4 * (12 << 20) // 4096


def _probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_step_buffers_stay_in_heap() -> None:
    default = _probe("none")
    kept = _probe("heap")
    assert kept["set"] and kept["faults_per_step"] < PAGES_PER_STEP / 8, kept
    # glibc's defaults give most of them back to the system every step
    assert default["faults_per_step"] > 3 * kept["faults_per_step"], (default, kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_cpu_lookup_sets_it() -> None:
    result = _probe("lookup")
    assert result["set"] and result["faults_per_step"] < PAGES_PER_STEP / 8, result


def test_the_environment_s_choice_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert not heap.user_chose_malloc_settings()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=1")
    assert not heap.user_chose_malloc_settings()
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    assert heap.user_chose_malloc_settings()
    monkeypatch.delenv("MALLOC_MMAP_MAX_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    assert heap.user_chose_malloc_settings()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_environment_s_choice_wins() -> None:
    tunables = _probe("heap", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert not tunables["set"], tunables
    assert tunables["faults_per_step"] > PAGES_PER_STEP / 4, tunables


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_key_value_process_gives_freed_buffers_back() -> None:
    """After `leave_heap_to_glibc` (a lookup with key-value tables calls it) the settings are
    undone and stay undone: freed temporaries leave the heap, as under glibc's defaults."""
    declined = _probe("declined")
    assert not declined["set"], declined
    assert declined["faults_per_step"] > PAGES_PER_STEP / 4, declined
