"""The `cluster` fixture: 2 simulated hosts (scripts/cluster.py) for the tests in this folder.

Where namespaces cannot be made (no root, no unshare/nsenter/ip/tc, a container without the
right), the tests skip and the reason names what is missing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

_HERE = Path(__file__).resolve().parent
for path in (str(_HERE.parents[1]), str(_HERE)):  # the repo root (scripts/, examples/), here
    if path not in sys.path:
        sys.path.insert(0, path)

from scripts.cluster import Cluster, missing  # noqa: E402


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """Two hosts, host0 and host1, links at 10gbit; every job started on it ends with it."""
    gaps = missing()
    if gaps:
        pytest.skip(f"simulated cluster needs: {'; '.join(gaps)}")
    with Cluster(hosts=2) as built:
        yield built
