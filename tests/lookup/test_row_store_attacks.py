"""Key-value tables' files under attack and damage (`recshard.lookup.row_store`): a table file
replaced by a symlink to another user's file or by a file of another size, a file planted
before creation, a directory every user can write, a damaged (truncated) file, a full disk (a
small tmpfs mounted inside a mount namespace of the test's own, never on the host). Each is a
clear error naming the table and file, or changes nothing: never another file's bytes read or
written, never a half-made shard left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from recshard.lookup.row_store import RowStore, StoreIdentity, check_directory
from tests.lookup.test_key_value_cache import _kernels
from tests.python_script import run_script

NOBODY = 65534
IDENTITY = StoreIdentity("t", 64, 5, 0, 0, {"weight": 5, "momentum1": 1})


def _victim(tmp_path: Path, size: int) -> tuple:
    """Another user's file (owned by `nobody`) of `size` floats, and its bytes."""
    other = tmp_path / "other-user"
    other.mkdir()
    victim = other / "victim"
    data = torch.arange(size, dtype=torch.float32) + 1000
    data.numpy().tofile(victim)
    os.chown(victim, NOBODY, NOBODY)
    return victim, data


def _swap(path: Path, replacement: Path, symlink: bool) -> None:
    """Put `replacement` where `path` was (as anyone who can write the directory could)."""
    os.rename(path, f"{path}.moved")
    if symlink:
        os.symlink(replacement, path)
    else:
        shutil.copy(replacement, path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to nobody needs root")
@pytest.mark.parametrize("symlink", [True, False], ids=["symlink", "file-of-another-size"])
def test_a_replaced_table_file_is_never_read_or_written(tmp_path: Path, symlink: bool) -> None:
    """The weight and momentum files replaced after creation (a symlink to another user's file
    of the same size, or a copy of a file of another size): state dicts still read the
    table's own rows, and a write through them (a checkpoint load) lands in the table, not in
    the other file. Before, `view` reopened the path: it mapped the other user's file."""
    store = tmp_path / "store"
    store.mkdir()
    memory, kv = _kernels("exact_row_wise_adagrad", str(store))
    victim, data = _victim(tmp_path, 64 * 5 if symlink else 17)
    for suffix in ("weight", "momentum1"):
        _swap(store / f"{IDENTITY.stem}.{suffix}", victim, symlink)
    weight = kv.table_weights()[0]
    assert torch.equal(weight, memory.table_weights()[0])
    momentum = kv.optimizer_states()[0]["momentum1"]
    assert torch.equal(momentum, torch.zeros(64))
    weight[3] = -5.0
    momentum[3] = 7.0
    assert torch.equal(torch.from_file(str(victim), size=data.numel()), data)
    assert os.stat(victim).st_uid == NOBODY
    assert torch.equal(kv.table_weights()[0][3], torch.full((5,), -5.0))
    assert float(kv.optimizer_states()[0]["momentum1"][3]) == 7.0


def test_a_damaged_table_file_is_a_clear_error(tmp_path: Path) -> None:
    """The table's own file cut short (damage, or another process of the same user): a cache
    miss on a row past the new end and a state-dict view both raise naming the table and the
    file, instead of returning zeros or faulting (SIGBUS) on the mapping."""
    memory, kv = _kernels("exact_sgd", str(tmp_path))
    path = tmp_path / f"{IDENTITY.stem}.weight"
    os.truncate(path, 10 * 5 * 4)  # rows 0..9 remain
    from recshard import KeyedJaggedTensor

    batch = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([40]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match=rf"table 't': reading rows of '{path}' failed: .*short"):
        kv(batch)
    with pytest.raises(RuntimeError, match=rf"table 't': '{path}' holds 200 bytes, not the 1280"):
        kv.table_weights()


def test_a_directory_every_user_can_write_is_refused(tmp_path: Path) -> None:
    """Mode 0777 without the sticky bit: anyone could delete or replace the tables' files, so
    the directory is refused before any file is made; with the sticky bit (as /tmp) others
    cannot touch files they do not own, and it is accepted."""
    os.chmod(tmp_path, 0o777)
    with pytest.raises(ValueError, match=r"tables t: .* is writable by every user \(mode 777"):
        check_directory(str(tmp_path), [IDENTITY])
    assert os.listdir(tmp_path) == []
    os.chmod(tmp_path, 0o1777)
    check_directory(str(tmp_path), [IDENTITY])
    os.chmod(tmp_path, 0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to nobody needs root")
@pytest.mark.parametrize("plant", ["file", "dangling-symlink"])
def test_a_file_planted_before_creation_is_refused(tmp_path: Path, plant: str) -> None:
    """Another user's file (or a symlink pointing where a table file will go) already under a
    table file's name: the directory check names it, and creation itself (O_EXCL) refuses it
    too, removing the files it had made and leaving the planted one alone."""
    planted = tmp_path / f"{IDENTITY.stem}.momentum1"
    if plant == "file":
        planted.write_bytes(b"\0" * 64)
        os.chown(planted, NOBODY, NOBODY)
    else:
        os.symlink(tmp_path / "elsewhere", planted)
    with pytest.raises(ValueError, match=rf"table 't': '{planted}' already exists"):
        check_directory(str(tmp_path), [IDENTITY])
    with pytest.raises(RuntimeError, match=r"table 't': cannot create its key_value files"):
        RowStore(str(tmp_path), IDENTITY)
    assert os.listdir(tmp_path) == [planted.name]
    assert not (tmp_path / "elsewhere").exists()


def _namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


FULL_DISK = """
import os, sys, torch
from recshard.lookup.row_store import RowStore, StoreIdentity, check_directory
directory = sys.argv[1]
big = StoreIdentity("big", 100000, 4, 0, 0, {"weight": 4, "momentum1": 1})
try:
    check_directory(directory, [big])
except ValueError as e:
    print("check:", e)
try:  # the space went between the check and creation
    RowStore(directory, big)
except RuntimeError as e:
    print("create:", e)
print("left:", sorted(os.listdir(directory)))
small = StoreIdentity("small", 8, 4, 0, 0, {"weight": 4})
store = RowStore(directory, small)  # reserved at creation: its writes cannot meet a full disk
filler = os.path.join(directory, "filler")
with open(filler, "wb", buffering=0) as f:
    try:
        while True:
            f.write(b"x" * 4096)
    except OSError as e:
        print("disk full:", e.errno == 28)
store.write("weight", torch.arange(8), torch.ones(8, 4))
print("rows:", store.read("weight", torch.arange(8)).sum().item())
"""


@pytest.mark.skipif(not _namespaces_work(), reason="no mount namespaces here")
def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    """A 256 KiB tmpfs (mounted in a mount namespace the test makes; the host never sees it):
    a shard needing 2 MB is refused by the directory check naming the bytes, and creation
    without that check (the space gone in between) fails naming the table and removes the
    files it had made, instead of leaving a half-made shard that blocks the next try. A shard
    created in time keeps its reserved space: writes after the disk filled up still land."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = textwrap.dedent(FULL_DISK)
    shell = (
        f"mount -t tmpfs -o size=256k,mode=0700 tmpfs {mount} && "
        f"{sys.executable} -c '{script}' {mount}"
    )
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[0].startswith("check: key_value tables big: need 2000000 bytes in"), lines
    assert "only" in lines[0] and "are free" in lines[0]
    assert lines[1].startswith("create: table 'big': cannot create its key_value files"), lines
    assert "No space left on device" in lines[1]
    assert lines[2] == "left: []"
    assert lines[3:5] == ["disk full: True", "rows: 32.0"]
    assert os.listdir(mount) == []  # the host never saw the tmpfs


SHORT_WRITE = """
import os, resource, sys, torch
from recshard.lookup.row_store import RowStore, StoreIdentity
directory = sys.argv[1]
store = RowStore(directory, StoreIdentity("t", 1000, 4, 0, 0, {"weight": 4}))
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
try:  # rows 500..519: bytes 8000..8320, the file-size limit at 8192 cuts the run short
    store.write("weight", torch.arange(500, 520), torch.ones(20, 4))
except RuntimeError as e:
    print("write:", e)
try:
    RowStore(directory, StoreIdentity("big", 1000, 4, 0, 0, {"weight": 4, "m": 1}))
except RuntimeError as e:
    print("create:", e)
print("left:", sorted(os.listdir(directory)))
"""


def test_a_short_write_is_an_error_naming_table_and_file(tmp_path: Path) -> None:
    """A write that moves only part of its run (here a file-size limit, RLIMIT_FSIZE, in a
    child process: pwritev returns short, then EFBIG) raises naming the table and the file;
    a creation past the limit fails naming the table and leaves none of its files."""
    result = run_script(SHORT_WRITE, str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    path = tmp_path / "t.r0.c0.1000x4.weight"
    assert (
        lines[0] == f"write: table 't': writing rows of '{path}' failed: [Errno 27] File too large"
    )
    assert lines[1].startswith("create: table 'big': cannot create its key_value files")
    assert lines[2] == "left: ['t.r0.c0.1000x4.json', 't.r0.c0.1000x4.weight']"


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"
)
def test_another_user_swapping_the_files_changes_nothing() -> None:
    """User `nobody` (a real process under setpriv) replaces the table files with symlinks to
    its own file, in a directory opened up to it after creation: the table's state dict
    still reads and writes the table's own rows, and nobody's file is untouched."""
    with tempfile.TemporaryDirectory(prefix="recshard-audit-") as top:  # pytest's is 0700
        _swapped_by_nobody(Path(top))


def _swapped_by_nobody(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    memory, kv = _kernels("exact_row_wise_adagrad", str(store))
    os.chmod(tmp_path, 0o755)
    os.chmod(store, 0o777)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chmod(theirs, 0o777)
    bait = theirs / "bait"
    swap = " && ".join(
        f"mv {path} {theirs}/taken.{suffix} && ln -s {bait} {path}"
        for suffix in ("weight", "momentum1")
        for path in [store / f"{IDENTITY.stem}.{suffix}"]
    )
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c"]
    subprocess.run(
        [*as_nobody, f"head -c 1280 /dev/zero > {bait} && {swap}"], check=True, timeout=30
    )
    assert os.stat(bait).st_uid == NOBODY and (store / f"{IDENTITY.stem}.weight").is_symlink()
    weight = kv.table_weights()[0]
    assert torch.equal(weight, memory.table_weights()[0])
    weight[1] = 3.0
    kv.optimizer_states()[0]["momentum1"][1] = 4.0
    assert bait.read_bytes() == b"\0" * 1280
    assert float(kv.table_weights()[0][1, 0]) == 3.0
