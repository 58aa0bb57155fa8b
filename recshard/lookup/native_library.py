"""recshard's optional C++ libraries (setup.py's extensions), opened through ctypes once per
process. A missing or unloadable build logs one warning saying what runs instead; callers then
take their fallback path."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from typing import Callable

logger = logging.getLogger(__name__)


class NativeLibrary:
    """The extension module `module` (e.g. `recshard.lookup._cpu_tbe`) as a `ctypes.CDLL`, its
    functions' signatures set by `declare`; `what` names it and `fallback` says what runs
    without it, in the one warning."""

    def __init__(
        self, module: str, what: str, fallback: str, declare: Callable[[ctypes.CDLL], None]
    ) -> None:
        self.module, self.what, self.fallback, self.declare = module, what, fallback, declare
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
