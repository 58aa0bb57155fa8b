"""recshard's C++ libraries are opened from the installed package only: a shared object of the
same name planted in the working directory, on LD_LIBRARY_PATH, or beside a checkpoint (a
directory a user may load from) is never opened, whether the process starts there or changes
into it after importing recshard. The planted objects run code when opened (an ELF
constructor that writes a marker file); the marker must not appear, and the process's
mappings must show each library at its path inside the package. (The libraries' own
dependencies, libstdc++ and libc, resolve through LD_LIBRARY_PATH as torch's do: the process's
environment, which recshard does not choose.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import recshard.lookup

PACKAGE = Path(recshard.lookup.__file__).resolve().parent
PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(MARKER, "a");
  if (f) { fputs("planted library ran\n", f); fclose(f); }
}
int rs_tbe_forward(void) { return 0; }
int rs_rows_io(void) { return 0; }
"""
CHILD = r"""
import os, sys, torch
directory = sys.argv[1]
os.chdir(directory)  # after import: a relative origin would now resolve here
from recshard.lookup import native_row_io, native_tbe
assert native_tbe.available() and native_row_io.available()
layout = native_tbe.TableLayout.of([3], [4], [0])
out = native_tbe.forward(torch.ones(12), layout, torch.tensor([2]), torch.tensor([0, 1]), None,
                         False, 1)
assert out.tolist() == [[1.0, 1.0, 1.0, 1.0]]
maps = open("/proc/self/maps").read().split("\n")
print("\n".join(sorted({line.split()[-1] for line in maps if "_cpu_tbe" in line
                        or "_row_io" in line})))
"""


@pytest.mark.skipif(not shutil.which("gcc"), reason="no C compiler to build the planted object")
def test_libraries_open_only_from_the_package(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    planted = tmp_path / "planted"
    checkpoint = tmp_path / "checkpoint"
    for d in (planted, checkpoint):
        d.mkdir()
    source = tmp_path / "plant.c"
    source.write_text(PLANT)
    built = tmp_path / "plant.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", built, source], check=True
    )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for d in (planted, checkpoint):
        for name in ("_cpu_tbe", "_row_io"):
            for ending in (suffix, ".abi3.so", ".so"):
                shutil.copy(built, d / f"{name}{ending}")
    # the planted objects do run when something opens them
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL('{built}')"], check=True)
    assert marker.read_text() == "planted library ran\n"
    marker.unlink()

    env = {
        **os.environ,
        "LD_LIBRARY_PATH": f"{planted}:{checkpoint}",
        "PYTHONPATH": str(PACKAGE.parent.parent),
    }
    for start, into in ((planted, checkpoint), (checkpoint, planted)):
        result = subprocess.run(
            [sys.executable, "-c", CHILD, str(into)],
            cwd=start,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert not marker.exists(), "a planted library was opened"
        opened = result.stdout.split()
        assert sorted(Path(p).name for p in opened) == sorted(
            [f"_cpu_tbe{suffix}", f"_row_io{suffix}"]
        ), opened
        assert all(Path(p).parent.resolve() == PACKAGE for p in opened), opened


@pytest.mark.skipif(not shutil.which("gcc"), reason="no C compiler to build the stale library")
def test_a_build_older_than_the_code_warns_and_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An extension built before a function was added (a source tree updated without
    `pip install -e .`): one warning naming the missing function and the fallback, instead of
    an AttributeError from the first lookup's construction."""
    from recshard.lookup import native_tbe
    from recshard.lookup.native_library import NativeLibrary

    source = tmp_path / "stale.c"
    source.write_text("long rs_tbe_forward(void) { return -1; }\n")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", tmp_path / f"stale_cpu_tbe{suffix}", source], check=True
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    library = NativeLibrary(
        "stale_cpu_tbe", "CPU embedding kernel", "torch runs", native_tbe._declare, "stale.c"
    )
    with caplog.at_level("WARNING", logger="recshard.lookup.native_library"):
        assert library.load() is None
        assert library.load() is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "rs_tbe_backward" in warnings[0] and "torch runs" in warnings[0], warnings


@pytest.mark.skipif(not shutil.which("gcc"), reason="no C compiler to build the library")
def test_a_build_older_than_its_source_is_not_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The C++ source beside the extension changed after the build (a `git pull` without
    `pip install -e .`): a function's signature may have changed, which ctypes cannot see,
    and calling it with the new arguments would read and write past buffers. The library is
    not opened (not even its constructors run): one warning, and the fallback runs."""
    from recshard.lookup.native_library import NativeLibrary

    marker = tmp_path / "marker"
    source = tmp_path / "newer.c"
    source.write_text(PLANT)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = tmp_path / f"newer_cpu_tbe{suffix}"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", built, source], check=True
    )
    os.utime(built, (1_000_000, 1_000_000))
    os.utime(source, (2_000_000, 2_000_000))
    monkeypatch.syspath_prepend(str(tmp_path))
    library = NativeLibrary(
        "newer_cpu_tbe", "CPU embedding kernel", "torch runs", _declare_none, "newer.c"
    )
    with caplog.at_level("WARNING", logger="recshard.lookup.native_library"):
        assert library.load() is None
    assert not marker.exists()
    assert f"built before {source} last changed" in caplog.records[0].getMessage()
    os.utime(built, (3_000_000, 3_000_000))  # rebuilt: opened
    assert NativeLibrary("newer_cpu_tbe", "", "", _declare_none, "newer.c").load() is not None
    assert marker.exists()
    header = tmp_path / "newer.h"  # any of an extension's sources: a header changed since
    header.write_text("")
    os.utime(header, (4_000_000, 4_000_000))
    caplog.clear()
    with caplog.at_level("WARNING", logger="recshard.lookup.native_library"):
        stale = NativeLibrary("newer_cpu_tbe", "", "", _declare_none, "newer.c", "newer.h")
        assert stale.load() is None
    assert f"built before {header} last changed" in caplog.records[0].getMessage()


def _declare_none(library: object) -> None:
    """A library whose functions this test never calls: nothing to declare."""
