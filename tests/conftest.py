"""Make the shared test helpers (`multiprocess`, case modules) importable from every folder."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for path in (_HERE, os.path.join(_HERE, "distributed")):
    if path not in sys.path:
        sys.path.insert(0, path)
