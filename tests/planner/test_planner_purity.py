"""The planner plans on metadata alone: importing it loads none of the embedding stack
(comm, lookup, sharding, distributed, calibration) and not fbgemm, so it runs on a laptop for
a 1000-rank topology. Checked in a fresh interpreter, as a user's `import recshard.planner`
would run.

torch.distributed: `import torch` itself loads `torch.distributed.distributed_c10d` (the
process-group collectives), and `recshard.types` (the plan's data types, under every layer)
loads torch's `_shard` package for `ParameterSharding.sharding_spec` (TorchRec's field), which
loads the autograd collectives of `torch.distributed.nn`. The planner adds no torch.distributed
module beyond those two: before this change it loaded `torch.distributed.nn` through
`recshard.comm` as well, and fbgemm's kernels' Python side through `recshard.lookup`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
STACK = ("comm", "lookup", "sharding", "distributed", "calibration")


def _modules(*names: str) -> List[List[str]]:
    """[sys.modules before, after] importing the last of `names` in a fresh interpreter that
    has imported torch and the others (`loaded_modules.py`)."""
    script = ROOT / "tests" / "planner" / "loaded_modules.py"
    done = subprocess.run(
        [sys.executable, str(script), *names],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_planner_loads_no_collectives_and_no_kernels() -> None:
    torch_modules, planner_modules = _modules("recshard.planner")
    new = set(planner_modules) - set(torch_modules)
    assert "recshard.planner.search.planner" in new  # the import did happen
    assert sorted(m for m in new if m.split(".")[0] == "fbgemm_gpu") == []
    stack = sorted(m for m in new if m.split(".")[:2][-1] in STACK and m.startswith("recshard."))
    assert stack == []
    types_modules, with_planner = _modules("recshard.types", "recshard.planner")
    added = set(with_planner) - set(types_modules)
    assert sorted(m for m in added if m.startswith("torch.distributed")) == []
