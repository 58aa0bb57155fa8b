"""Take one of recshard's C++ libraries away inside a test: its extension is not found and its
`NativeLibrary` is a fresh one (not yet loaded in this process, so it warns once)."""

from __future__ import annotations

from types import ModuleType

import pytest

from recshard.lookup import native_library


def take_library_away(monkeypatch: pytest.MonkeyPatch, owner: ModuleType, extension: str) -> None:
    """`owner` (e.g. `native_row_io`) keeps its library in `_LIBRARY`; `extension` is the
    module name of the built library (e.g. `recshard.lookup._row_io`)."""
    find_spec = native_library.importlib.util.find_spec
    monkeypatch.setattr(
        native_library.importlib.util,
        "find_spec",
        lambda name, *a: None if name == extension else find_spec(name, *a),
    )
    shipped = owner._LIBRARY
    fresh = native_library.NativeLibrary(
        shipped.module, shipped.what, shipped.fallback, shipped.declare
    )
    monkeypatch.setattr(owner, "_LIBRARY", fresh)
