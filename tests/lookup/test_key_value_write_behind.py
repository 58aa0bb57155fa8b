"""The key-value cache's write-behind (`recshard.lookup.key_value`): an updated row evicted is
written back on a thread while the step goes on; a later miss on that row must read the
written value, never the stale one still in the file.

Storage is made slow (each row write waits 50 ms before it lands, the rest of RowStore
unchanged) so that a read racing the write would see the old bytes. Single caller (a step,
and the pipeline's prefetch of the next batch on its own thread during backward): results
equal the in-memory torch kernel's bytes; so do two threads missing in one cache at once (no
caller does this today), and steps after a failed write-back once storage works again."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Tuple

import pytest
import torch

from recshard import KeyedJaggedTensor
from recshard.lookup import key_value_cache
from recshard.lookup.row_store import RowStore
from tests.lookup.test_key_value_cache import _kernels
from tests.python_script import run_script

WRITE_DELAY_S = 0.05


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every RowStore row write lands WRITE_DELAY_S late (a slow device)."""
    write = RowStore.write

    def late_write(self: RowStore, suffix: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        time.sleep(WRITE_DELAY_S)
        write(self, suffix, ids, values)

    monkeypatch.setattr(RowStore, "write", late_write)
    yield


def _batch(step: int) -> KeyedJaggedTensor:
    """3 of 7 rows, 2 new each step: rows leave the 4-row cache updated and come back a
    step or two later, while their write-back may still be in flight."""
    ids = [(step * 2 + k) % 7 for k in range(3)]
    return KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids), torch.tensor([2, 1]))


def _same_bytes(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{what}: {(a - b).abs().max()}"


def _step_in_memory(
    memory: torch.nn.Module, kv: torch.nn.Module, step: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Batch `step` through both kernels (outputs compared) and the in-memory one's backward:
    the key-value output and the gradient its backward is to take."""
    features = _batch(step)
    out, kv_out = memory(features), kv(features)
    _same_bytes(out.detach(), kv_out.detach(), f"output of step {step}")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
    (out * grad).sum().backward()
    return kv_out, grad


@pytest.mark.parametrize("prefetch_thread", [False, True], ids=["step", "pipeline-prefetch"])
@pytest.mark.parametrize("optimizer", ["exact_sgd", "exact_row_wise_adagrad"])
def test_a_row_read_back_while_its_write_back_is_in_flight_is_fresh(
    slow_writes: None, optimizer: str, prefetch_thread: bool
) -> None:
    """12 steps whose misses hit rows written back (late) by the step before; with
    `prefetch_thread`, batch i+1 is prefetched on a thread during batch i's backward, as
    `PrefetchTrainPipelineSparseDist` does, into a cache of 5 rows (batch i's 3 stay pinned
    until its update, batch i+1 brings 2 new ones; a prefetch that overflowed would fail the
    test, not pass it by leaving the rows to the next forward). Outputs, weights and state:
    the in-memory kernel's bytes."""
    with tempfile.TemporaryDirectory() as directory:
        memory, kv = _kernels(optimizer, directory, cached_rows=5 if prefetch_thread else 4)
        errors: list = []

        def prefetch(features: KeyedJaggedTensor) -> None:
            try:
                kv.prefetch(features)
            except BaseException as e:  # noqa: BLE001 - checked on the test's thread
                errors.append(e)

        for step in range(12):
            kv_out, grad = _step_in_memory(memory, kv, step)
            side = threading.Thread(target=prefetch, args=(_batch(step + 1),))
            if prefetch_thread:
                side.start()
            (kv_out * grad).sum().backward()
            if prefetch_thread:
                side.join()
                assert not errors, f"step {step}'s prefetch of the next batch: {errors[0]}"
        assert kv.hit_rate() < 0.6
        _same_bytes(memory.table_weights()[0], kv.table_weights()[0], "weights")
        for name, value in memory.optimizer_states()[0].items():
            _same_bytes(value, kv.optimizer_states()[0][name], name)


class _FirstComesFirst:
    """`cache.fill_lock` for the race below: the thread named `late` takes it only after the
    thread named `early` has taken and released it once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.early_done = threading.Event()

    def __enter__(self) -> None:
        if threading.current_thread().name == "late":
            assert self.early_done.wait(10)
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if threading.current_thread().name == "early":
            self.early_done.set()


def test_two_threads_missing_at_once_read_no_stale_row(slow_writes: None) -> None:
    """Thread `late` starts its fill first but takes the cache's fill lock only after thread
    `early` evicted updated row 0 (its write-back starts, slow) and returned; `late` then
    misses on row 0 while that write is in flight: it must get the updated row. (A fill that
    looked for writes in flight before taking the lock cached the stale bytes here.)"""
    with tempfile.TemporaryDirectory() as directory:
        _, kv = _kernels("exact_sgd", directory)
        cache = kv.caches[0]
        start = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([0]), torch.tensor([1]))
        kv(start).sum().backward()  # row 0 updated, cached, not yet written
        updated = cache.values["weight"][int(cache.row_slot[0])].clone()
        cache.fill_lock = _FirstComesFirst()
        fill = KeyedJaggedTensor.from_lengths_sync(
            ["f"], torch.tensor([1, 2, 3, 4]), torch.tensor([4])
        )
        again = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([0]), torch.tensor([1]))
        errors = []

        def run(features: KeyedJaggedTensor) -> None:
            try:
                kv.prefetch(features)
            except BaseException as e:  # noqa: BLE001 - raised below
                errors.append(e)

        early = threading.Thread(target=run, args=(fill,), name="early")
        late = threading.Thread(target=run, args=(again,), name="late")
        late.start()
        time.sleep(0.1)  # `late` waits for the fill lock
        early.start()
        early.join()
        late.join()
        assert not errors, errors
        _same_bytes(updated, cache.values["weight"][int(cache.row_slot[0])], "row 0 read back")


@pytest.mark.parametrize("slow", [False, True], ids=["fails-at-once", "fails-late"])
def test_rows_of_a_failed_write_back_are_not_silently_lost(
    slow: bool, request: pytest.FixtureRequest
) -> None:
    """Storage refuses writes for a while (a read-only descriptor, as a failing device): the
    step after the failed write-back raises. Storage then works again and training goes on:
    either every later step refuses (the table is known to be stale), or the table ends equal
    to the in-memory kernel's on the steps both ran. `slow`: each write fails 50 ms late, so a
    fill that misses a row being written has chosen its slots when it finds the failure (it
    undoes its books and raises)."""
    if slow:
        request.getfixturevalue("slow_writes")
    with tempfile.TemporaryDirectory() as directory:
        memory, kv = _kernels("exact_sgd", directory)
        store = kv.caches[0].store
        writable = store._fds["weight"]
        store._fds["weight"] = os.open(store.paths["weight"], os.O_RDONLY)
        ran_after_recovery = False
        for step in range(14):
            if step == 6:  # storage recovers
                os.close(store._fds["weight"])
                store._fds["weight"] = writable
            features = _batch(step)
            try:
                kv_out = kv(features)
            except RuntimeError as e:
                assert "writing rows of" in str(e)
                continue
            ran_after_recovery |= step >= 6
            out = memory(features)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            (out * grad).sum().backward()
            (kv_out * grad).sum().backward()
        if not ran_after_recovery:
            return  # every step refused once storage had failed: nothing silent
        torch.testing.assert_close(kv.table_weights()[0], memory.table_weights()[0])


def test_a_write_back_thread_that_cannot_start_is_written_by_the_next_fill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The system refuses every write-behind thread (`can't start new thread`): no step
    raises or waits forever on a write that never ran, and the table keeps the in-memory
    kernel's bytes (each refused write-back is written by the fill that evicted it)."""

    def refuse(*args: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(key_value_cache, "_thread", SimpleNamespace(start_new_thread=refuse))
    with tempfile.TemporaryDirectory() as directory:
        memory, kv = _kernels("exact_row_wise_adagrad", directory)
        for step in range(12):
            kv_out, grad = _step_in_memory(memory, kv, step)
            (kv_out * grad).sum().backward()
        _same_bytes(memory.table_weights()[0], kv.table_weights()[0], "weights")
        for name, value in memory.optimizer_states()[0].items():
            _same_bytes(value, kv.optimizer_states()[0][name], name)


EXIT_WITH_WRITES_IN_FLIGHT = """
import sys, tempfile, time
from recshard.lookup.row_store import RowStore
from tests.lookup.test_key_value_cache import _kernels
from tests.lookup.test_key_value_write_behind import _batch

write = RowStore.write

def late_write(self, suffix, ids, values):
    print("started", flush=True)
    time.sleep(0.3)
    write(self, suffix, ids, values)
    print("landed", flush=True)

RowStore.write = late_write
memory, kv = _kernels("exact_sgd", tempfile.mkdtemp(dir=sys.argv[1]))
for step in range(4):
    kv(_batch(step)).sum().backward()
"""


def test_exit_with_write_backs_in_flight_waits_for_them(tmp_path: Path) -> None:
    """The interpreter exits while write-backs are in flight (each lands 0.3 s late): each
    lands, and the process exits cleanly (a write-behind thread that freed its tensors during
    exit was stopped inside torch: "terminate called without an active exception", SIGABRT,
    about one exit in two)."""
    for _ in range(3):
        result = run_script(EXIT_WITH_WRITES_IN_FLIGHT, str(tmp_path))
        assert result.returncode == 0, result.stderr
        lines = result.stdout.split()
        assert lines.count("started") > 0
        assert lines.count("landed") == lines.count("started"), result.stdout


def test_a_child_forked_with_write_backs_in_flight_exits(slow_writes: None) -> None:
    """A process forked while write-backs are in flight (their threads are not in the child)
    runs its exit handlers without waiting for them."""
    with tempfile.TemporaryDirectory() as directory:
        _, kv = _kernels("exact_sgd", directory)
        for step in range(3):
            kv(_batch(step)).sum().backward()
        assert key_value_cache._IN_FLIGHT, "no write-back in flight to fork beside"
        child = os.fork()
        if child == 0:
            code = 0 if not key_value_cache._IN_FLIGHT else 1
            try:
                key_value_cache._finish_write_backs()
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(child, 9)
            os.waitpid(child, 0)
            raise AssertionError("the forked child waited for write-backs it does not run")
        assert os.waitstatus_to_exitcode(status) == 0
        key_value_cache._finish_write_backs()  # the parent waits for its own
