"""The C++ row I/O of key_value tables (`native_row_io`) against the Python path, and its
errors: the same bytes in the files and the buffers, failures naming the table and file, and
buffers it would overrun refused before the call."""

from __future__ import annotations

import os

import pytest
import torch

from recshard.lookup import native_library, native_row_io
from recshard.lookup.row_store import RowStore, StoreIdentity
from tests.lookup.native_missing import take_library_away

ROWS, WIDTH = 3000, 5

needs_native = pytest.mark.skipif(
    not native_row_io.available(), reason="recshard.lookup._row_io is not built"
)


@pytest.fixture(params=["native", "python"])
def path(request, monkeypatch) -> str:  # noqa: ANN001
    if request.param == "native" and not native_row_io.available():
        pytest.skip("recshard.lookup._row_io is not built")
    if request.param == "python":
        monkeypatch.setattr(native_row_io, "available", lambda: False)
    return request.param


def _store(directory: str, name: str = "t") -> RowStore:
    identity = StoreIdentity(name, ROWS, WIDTH, 0, 0, {"weight": WIDTH, "momentum1": 1})
    store = RowStore(directory, identity)
    store.fill("weight", 0, torch.arange(ROWS * WIDTH, dtype=torch.float32).view(ROWS, WIDTH))
    return store


def _batch(generator: torch.Generator) -> torch.Tensor:
    """Sorted unique rows: scattered ones, short runs, and a run longer than IOV_MAX."""
    scattered = torch.randperm(ROWS, generator=generator)[:300]
    return torch.unique(torch.cat([scattered, torch.arange(10, 14), torch.arange(1200, 2600)]))


def test_native_reads_and_writes_what_python_does(tmp_path, path: str) -> None:  # noqa: ANN001
    generator = torch.Generator().manual_seed(0)
    ids = _batch(generator)
    store = _store(str(tmp_path))
    values = torch.randn(ids.numel(), WIDTH, generator=generator)
    store.write("weight", ids, values)
    expected = torch.arange(ROWS * WIDTH, dtype=torch.float32).view(ROWS, WIDTH)
    expected[ids] = values
    assert torch.equal(store.view("weight").view(ROWS, WIDTH), expected)  # the file itself

    slots = torch.randperm(ids.numel() + 50, generator=generator)[: ids.numel()]
    buffer = torch.full((ids.numel() + 50, WIDTH), -1.0)
    store.read_into("weight", ids, buffer, slots)
    untouched = torch.ones(buffer.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(buffer[slots], expected[ids])
    assert bool((buffer[untouched] == -1).all())
    assert torch.equal(store.read("weight", ids), expected[ids])
    store.close()


@needs_native
def test_native_and_python_paths_write_identical_files(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    generator = torch.Generator().manual_seed(1)
    ids = _batch(generator)
    values = torch.randn(ids.numel(), 1, generator=generator)
    native = _store(str(tmp_path), "native")
    native.write("momentum1", ids, values)
    monkeypatch.setattr(native_row_io, "available", lambda: False)
    python = _store(str(tmp_path), "python")
    python.write("momentum1", ids, values)
    assert torch.equal(native.view("momentum1"), python.view("momentum1"))
    native.close()
    python.close()


def test_failed_write_names_table_and_file(tmp_path, path: str) -> None:  # noqa: ANN001
    store = _store(str(tmp_path))
    read_only = os.open(store.paths["weight"], os.O_RDONLY)
    os.dup2(read_only, store._fds["weight"])  # the store's fd now refuses writes (EBADF)
    os.close(read_only)
    with pytest.raises(RuntimeError, match=r"table 't': writing rows of '.*t\.r0\.c0.*weight'"):
        store.write("weight", torch.tensor([3, 7]), torch.zeros(2, WIDTH))
    store.close()


def test_short_read_names_table_and_file(tmp_path, path: str) -> None:  # noqa: ANN001
    store = _store(str(tmp_path))
    os.truncate(store.paths["weight"], (ROWS - 2) * WIDTH * 4)  # the last two rows are gone
    with pytest.raises(RuntimeError, match=r"table 't': reading rows of '.*weight'.*short read"):
        store.read("weight", torch.tensor([5, ROWS - 1]))
    store.close()


@needs_native
@pytest.mark.parametrize(
    "rows, buffer, slots, message",
    [
        (torch.tensor([1, ROWS]), torch.zeros(4, WIDTH), None, "outside the 3000 rows"),
        (torch.tensor([-1, 2]), torch.zeros(4, WIDTH), None, "-1 is outside"),
        (torch.tensor([1, 2]), torch.zeros(4, WIDTH), torch.tensor([0, 4]), "4 is outside"),
        (torch.tensor([1, 2]), torch.zeros(4, WIDTH), torch.tensor([0]), "1 slots for 2"),
        (torch.tensor([1, 2, 3]), torch.zeros(2, WIDTH), None, "do not fit a buffer of 2"),
        (torch.tensor([1, 2]), torch.zeros(4, WIDTH, dtype=torch.float64), None, "fp32"),
        (torch.tensor([1, 2]), torch.zeros(WIDTH, 4).t(), None, "contiguous"),
        (torch.tensor([1, 2]), torch.zeros(4, WIDTH + 1), None, "rows of width 5"),
        (torch.tensor([1, 2], dtype=torch.int32), torch.zeros(4, WIDTH), None, "int64"),
        (torch.tensor([1, 2, 3])[::2], torch.zeros(4, WIDTH), None, "contiguous 1-D"),
    ],
)
def test_native_refuses_buffers_it_would_overrun(
    tmp_path,  # noqa: ANN001
    rows: torch.Tensor,
    buffer: torch.Tensor,
    slots: torch.Tensor | None,
    message: str,
) -> None:
    store = _store(str(tmp_path))
    before = buffer.clone()
    with pytest.raises(ValueError, match=message) as raised:
        store.read_into("weight", rows, buffer, slots)
    assert "table 't'" in str(raised.value)
    assert torch.equal(buffer, before)
    store.close()


def test_missing_library_warns_once_and_python_moves_the_rows(
    tmp_path,  # noqa: ANN001
    monkeypatch,  # noqa: ANN001
    caplog,  # noqa: ANN001
) -> None:
    take_library_away(monkeypatch, native_row_io, "recshard.lookup._row_io")
    with caplog.at_level("WARNING", logger=native_library.__name__):
        store = _store(str(tmp_path))
        store.write("weight", torch.tensor([2, 9]), torch.ones(2, WIDTH))
        assert torch.equal(store.read("weight", torch.tensor([2, 9])), torch.ones(2, WIDTH))
    warnings = [r for r in caplog.records if "row I/O library" in r.getMessage()]
    assert len(warnings) == 1 and "from Python" in warnings[0].getMessage()
    assert not native_row_io.available()
    store.close()
