"""Port TorchRec code to recshard: `python -m recshard.port [--check] FILES...` rewrites the
torchrec imports of scripts and notebooks (a libcst codemod) and reports what it cannot map.

`port_source(code)` and `port_notebook(text)` do the same on strings; `MODULE_MAP` is the table.
"""

from recshard.port.codemod import Issue, PortResult, port_source
from recshard.port.mapping import MODULE_MAP
from recshard.port.notebook import port_notebook

__all__ = ["Issue", "MODULE_MAP", "PortResult", "port_notebook", "port_source"]
