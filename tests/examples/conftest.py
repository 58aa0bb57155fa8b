"""Put the repo root on sys.path so `examples.dlrm` imports under plain `pytest` too."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
