"""Put tests/ and tests/parallel/ on sys.path (for `multiprocess` and `parallel_helpers`) and
run every multi-rank check once per world size, shared by all tests/parallel test files."""

from __future__ import annotations

import os
import sys
from typing import Dict, List

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from multiprocess import run_ranks  # noqa: E402
from parallel_helpers import CHECK_MODULES, RankResults, run_all_checks  # noqa: E402

WORLD_SIZES = [1, 2, 4]
_CACHE: Dict[int, RankResults] = {}


@pytest.fixture(scope="session", params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def rank_results(request: pytest.FixtureRequest) -> RankResults:
    """Outcome of every check in CHECK_MODULES on `world_size` gloo ranks (one group)."""
    world_size = request.param
    if world_size not in _CACHE:
        per_rank: List[Dict[str, str]] = run_ranks(
            world_size, run_all_checks, CHECK_MODULES, timeout=180, pg_timeout_s=30
        )
        _CACHE[world_size] = RankResults(world_size, per_rank)
    return _CACHE[world_size]
