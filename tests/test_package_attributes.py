"""`import recshard` alone reaches the subpackages as attributes, as `import torchrec` does."""

from __future__ import annotations

import subprocess
import sys

import pytest

import recshard


@pytest.mark.parametrize(
    "expr",
    [
        "recshard.distributed.DistributedModelParallel",
        "recshard.optim.CombinedOptimizer",
        "recshard.planner.EmbeddingShardingPlanner",
        "recshard.sparse.KeyedJaggedTensor",
    ],
)
def test_subpackage_reachable_after_import_recshard(expr: str) -> None:
    # a fresh interpreter: this test process has imported the subpackages already
    code = f"import recshard\nprint({expr}.__name__)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expr.rsplit(".", 1)[1]


def test_unknown_attribute_still_raises() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        recshard.no_such_thing  # noqa: B018
