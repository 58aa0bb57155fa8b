"""The key-value kernel's files without an `ssd_storage_directory`: a private temporary
directory per table, removed when the kernel is collected or when the process exits; a
directory the user gave is never removed. Each case runs in a fresh Python process (`-c`),
which prints the directories it used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import gc, json, sys, torch
from recshard import EmbeddingBagConfig
from recshard.lookup.fused_params import FusedParams
from recshard.lookup.key_value import KeyValueKernel
from recshard.lookup.tables import LocalTable
from recshard.types import EmbeddingComputeKernel

directory, ending = sys.argv[1] or None, sys.argv[2]
fused = {"optimizer": "exact_row_wise_adagrad", "learning_rate": 0.1}
if directory:
    fused["ssd_storage_directory"] = directory
params = FusedParams.parse(fused, "t")
configs = [
    EmbeddingBagConfig(num_embeddings=16, embedding_dim=4, name=name, feature_names=[name])
    for name in ("t0", "t1")
]
kind = EmbeddingComputeKernel.KEY_VALUE
tables = [LocalTable(c, 16, 4, 0, 0, kind, c.pooling, params) for c in configs]
kernel = KeyValueKernel(tables, True, params.optim, torch.device("cpu"))
kernel.table_weights()[0].add_(1.0)  # a mapped view of the files, as a state dict takes
used = sorted({cache.store.directory for cache in kernel.caches})
print(json.dumps(used), flush=True)
if ending == "collect":
    del kernel
    gc.collect()
    print(json.dumps([d for d in used if __import__("os").path.exists(d)]), flush=True)
"""


def _run(directory: str, ending: str) -> List[List[str]]:
    """The directories the process used, then (`collect`) those left after collection."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, directory, ending],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.parametrize("ending", ["collect", "exit"])
def test_the_temporary_directories_are_removed(ending: str) -> None:
    lines = _run("", ending)
    used = lines[0]
    assert len(used) == 2 and all("recshard-kv-" in d for d in used)
    if ending == "collect":
        assert lines[1] == []  # gone while the process still runs
    assert not any(os.path.exists(d) for d in used)


@pytest.mark.parametrize("ending", ["collect", "exit"])
def test_a_given_directory_is_kept(tmp_path: Path, ending: str) -> None:
    lines = _run(str(tmp_path), ending)
    assert lines[0] == [str(tmp_path)]
    assert tmp_path.is_dir() and len(list(tmp_path.iterdir())) > 0
