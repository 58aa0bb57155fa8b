"""`python loaded_modules.py BASE... TARGET`: import torch and the BASE modules, then TARGET;
print, as JSON, [the modules loaded before TARGET, the modules loaded after it] (run in a fresh
interpreter by the purity test)."""

from __future__ import annotations

import importlib
import json
import sys

import torch  # noqa: F401 - the baseline

if __name__ == "__main__":
    for base in sys.argv[1:-1]:
        importlib.import_module(base)
    before = sorted(sys.modules)
    importlib.import_module(sys.argv[-1])
    print(json.dumps([before, sorted(sys.modules)]))
