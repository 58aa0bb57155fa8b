"""`python -m recshard.calibration.probe NAME ARG...`: run one probe in this fresh process and
print its result as JSON (started by `recshard.calibration.fresh`)."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Dict, List

from recshard.calibration.memory import memory_probe, rank_overhead_probe

PROBES: Dict[str, Callable[..., Any]] = {
    "memory": memory_probe,
    "rank_overhead": rank_overhead_probe,
}


def main(argv: List[str]) -> int:
    if not argv or argv[0] not in PROBES:
        print(f"usage: probe {{{','.join(PROBES)}}} ARG...", file=sys.stderr)
        return 2
    print(json.dumps(PROBES[argv[0]](*(int(a) for a in argv[1:]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
