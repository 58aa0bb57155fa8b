"""recshard's optional C++ libraries (setup.py's extensions), opened through ctypes once per
process. A missing or unloadable build logs one warning saying what runs instead; callers then
take their fallback path. So does a build older than its C++ source beside it (a source tree
updated without `pip install -e .`): ctypes cannot see a changed signature, and calling a
function with the arguments of another version reads and writes past buffers."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from typing import Callable

logger = logging.getLogger(__name__)


class NativeLibrary:
    """The extension module `module` (e.g. `recshard.lookup._cpu_tbe`) as a `ctypes.CDLL`, its
    functions' signatures set by `declare`; `what` names it and `fallback` says what runs
    without it, in the one warning; `sources`: its C++ files, relative to the extension's
    directory (checked where they exist: editable installs; every extension names them)."""

    def __init__(
        self,
        module: str,
        what: str,
        fallback: str,
        declare: Callable[[ctypes.CDLL], None],
        *sources: str,
    ) -> None:
        self.module, self.what, self.fallback, self.declare = module, what, fallback, declare
        self.sources = sources
        self._library: ctypes.CDLL | None = None
        self._tried = False

    def load(self) -> ctypes.CDLL | None:
        """The library, or None (after one warning) when it is not built or does not load."""
        if self._tried:
            return self._library
        self._tried = True
        try:
            spec = importlib.util.find_spec(self.module)
            if spec is None or spec.origin is None:
                raise ImportError("not built")
            self._check_age(spec.origin)
            library = ctypes.CDLL(spec.origin)
            self.declare(library)  # a build older than this code lacks a function
        except (ImportError, OSError, AttributeError) as error:
            logger.warning(
                "recshard's %s (%s) is unavailable (%s): %s; `pip install -e .` builds it",
                self.what,
                self.module,
                error,
                self.fallback,
            )
            return None
        self._library = library
        return library

    def _check_age(self, origin: str) -> None:
        """ImportError when a C++ source beside the extension changed after it was built."""
        for name in self.sources:
            source = os.path.join(os.path.dirname(origin), name)
            if os.path.exists(source) and os.path.getmtime(source) > os.path.getmtime(origin):
                raise ImportError(f"built before {source} last changed")
