"""Save and load sharded training state; load into any world size or plan.

Layout under `path`: one directory per save (`ckpt-<id>/`: shard files written by
`torch.distributed.checkpoint`, each rank its own, a `manifest.json` describing them, and
`extra.json`) and a `LATEST` file naming the newest complete one. `LATEST` may only name a
sibling directory. Nothing is ever unpickled: the manifest is JSON (see `manifest.py`).
`LATEST` is replaced atomically after every rank has finished writing, so a process killed
mid-save leaves the previous checkpoint loadable. The previous directory
is kept until the next save completes; a half-written one left by a killed save is removed
by the next save that completes.

`load` is all or nothing. Every file is opened as a regular file inside the checkpoint
directory (`files.py`). Each rank resolves `LATEST`, parses the manifest (checking its HMAC
when a key is configured: `authenticity.py`) and checks that every key it needs is there with
the model's dtype and shape, and `extra.json`; the ranks then exchange verdicts together with
the checkpoint each one read (directory name and manifest hash), so a problem on any rank, or
ranks reading different checkpoints, raises the same error on every rank. Then every tensor is
read into staging buffers and checked (`staging.py`); a second exchange of verdicts; only then
is anything copied into the model and optimizer. On any error they are exactly as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from recshard.checkpoint.authenticity import checkpoint_key
from recshard.checkpoint.column_state import Relayout, plan_relayouts
from recshard.checkpoint.files import MIB, open_directory, read_small
from recshard.checkpoint.manifest import (
    EXTRA,
    MANIFEST,
    Manifest,
    ManifestWriter,
    parse_manifest,
    write_durably,
)
from recshard.checkpoint.staging import StagingReader, describe_key
from recshard.distributed.model_parallel import get_unwrapped_module
from recshard.distributed.sharded_state import (
    entry_state_keys,
    fused_optimizer_state,
    load_entries,
    model_state_dict,
    quiet_sharded_tensor,
)
from recshard.optim.fused import FusedOptimizer
from recshard.optim.keyed import CombinedOptimizer, KeyedOptimizer

LATEST = "LATEST"
LATEST_LIMIT = 4096
MANIFEST_LIMIT = 256 * MIB
EXTRA_LIMIT = 16 * MIB


def _dense_optimizers(optimizer: KeyedOptimizer | None) -> List[KeyedOptimizer]:
    """Dense (non-fused) keyed optimizers; their state is replicated, keyed by param FQN."""
    if optimizer is None:
        return []
    if isinstance(optimizer, CombinedOptimizer):
        return [d for _, opt in optimizer.optimizers for d in _dense_optimizers(opt)]
    return [] if isinstance(optimizer, FusedOptimizer) else [optimizer]


def _training_state(model: nn.Module, optimizer: KeyedOptimizer | None) -> Dict[str, Any]:
    module = get_unwrapped_module(model)
    state: Dict[str, Any] = {"model": model_state_dict(module)}
    if optimizer is not None:
        fused = fused_optimizer_state(module)
        if fused:
            state["fused_optim"] = fused
        dense: Dict[str, torch.Tensor] = {}
        for opt in _dense_optimizers(optimizer):
            opt.init_state()
            for fqn, entry in opt.state_dict()["state"].items():
                dense.update(
                    {
                        f"{fqn}.{name}": value
                        for name, value in entry.items()
                        if isinstance(value, torch.Tensor)
                    }
                )
        if dense:  # stateless optimizers (plain SGD) save no section, and load expects none
            state["dense_optim"] = dense
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _shared_name() -> str:
    name = [f"ckpt-{uuid.uuid4().hex[:12]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _step(what: str, where: Path, fn: Callable[[], Any], committed: bool = False) -> Any:
    """Run one collective step of `save`; a failure (a rank died, the process-group timeout,
    a full disk) says which step and which checkpoint. DCP raises `CheckpointException`, a
    BaseException that `except Exception` would miss: it comes out as a RuntimeError."""
    try:
        return fn()
    except (Exception, CheckpointException) as e:
        state = (
            "rank 0 may have committed it (see LATEST)"
            if committed
            else "the previous checkpoint is still the latest"
        )
        raise RuntimeError(
            f"saving checkpoint {where}: {what} failed; {state}: {_first_cause(e)}"
        ) from e


@quiet_sharded_tensor()
def save(
    path: str,
    model: nn.Module,
    optimizer: KeyedOptimizer | None = None,
    extra: Dict[str, Any] | None = None,
    key: bytes | str | None = None,
) -> str:
    """Write a checkpoint (collective: every rank calls it). Returns its directory.

    With a `key` (else `$RECSHARD_CHECKPOINT_KEY`) the manifest carries an HMAC-SHA256 that
    `load` with the same key checks."""
    secret = checkpoint_key(key)
    extra_text = json.dumps(extra or {})
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    directory = root / _step("agreeing on a directory name (broadcast)", root, _shared_name)
    state = _training_state(model, optimizer)
    _step(
        "writing shards (torch.distributed.checkpoint)",
        directory,
        lambda: dcp.save(state, storage_writer=ManifestWriter(str(directory), extra_text, secret)),
    )
    _step("waiting for every rank to finish writing (barrier)", directory, _barrier)
    if _rank() == 0:
        _fsync_directory(directory)
        previous = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
        tmp = root / f"{LATEST}.tmp"
        write_durably(tmp, directory.name)
        os.replace(tmp, root / LATEST)  # the commit point
        _fsync_directory(root)
        for stale in root.glob("ckpt-*"):
            if stale.name not in (directory.name, previous):
                shutil.rmtree(stale, ignore_errors=True)
    _step("waiting for rank 0 to commit LATEST (barrier)", directory, _barrier, committed=True)
    return str(directory)


def _fsync_directory(directory: Path) -> None:
    """Make renames and new entries in `directory` survive a machine crash (POSIX only)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_DIRECTORY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _open_latest(path: str) -> Tuple[Path, int]:
    """The directory `LATEST` names and a descriptor of it. It must be a real directory beside
    `LATEST` (a plain name, no path, no symlink), so write access to `LATEST` alone cannot
    point `load` anywhere else."""
    root = Path(path)
    pointer = root / LATEST
    try:
        root_fd = open_directory(root)
    except FileNotFoundError:
        raise FileNotFoundError(f"no complete checkpoint under {root} (no {LATEST} file)") from None
    try:
        try:
            raw = read_small(root_fd, LATEST, pointer, LATEST_LIMIT)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no complete checkpoint under {root} (no {LATEST} file)"
            ) from None
        try:
            name = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            name = ""
        if not _DIRECTORY_NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(
                f"{pointer}: must hold the name of a checkpoint directory beside it "
                f"(like 'ckpt-0123456789ab'), not {raw[:60]!r}"
            )
        try:
            return root / name, open_directory(Path(name), dir_fd=root_fd, follow=False)
        except (OSError, ValueError):
            raise ValueError(
                f"{pointer}: names {name!r}, which is not a directory beside it"
            ) from None
    finally:
        os.close(root_fd)


def _missing_manifest(directory: Path, dir_fd: int) -> ValueError:
    try:
        os.stat(".metadata", dir_fd=dir_fd, follow_symlinks=False)
        older = " (written by an older recshard, whose pickled .metadata is no longer read)"
    except OSError:
        older = ""
    return ValueError(f"checkpoint {directory} is incomplete or truncated (no {MANIFEST}){older}")


def latest_checkpoint(path: str) -> Path:
    """The directory `LATEST` names (a real directory beside it, holding a manifest)."""
    directory, dir_fd = _open_latest(path)
    try:
        os.stat(MANIFEST, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise _missing_manifest(directory, dir_fd) from None
    finally:
        os.close(dir_fd)
    return directory


@dataclass
class _Opened:
    """A checkpoint as this rank found it: its directory (and a descriptor of it), the parsed
    manifest, and what identifies it across ranks (directory name, manifest SHA-256)."""

    directory: Path
    dir_fd: int
    manifest: Manifest
    identity: Tuple[str, str]


def _open_checkpoint(path: str, key: bytes | None) -> _Opened:
    directory, dir_fd = _open_latest(path)
    try:
        try:
            data = read_small(dir_fd, MANIFEST, directory / MANIFEST, MANIFEST_LIMIT)
        except FileNotFoundError:
            raise _missing_manifest(directory, dir_fd) from None
        manifest = parse_manifest(data, directory / MANIFEST, key)
        return _Opened(
            directory, dir_fd, manifest, (directory.name, hashlib.sha256(data).hexdigest())
        )
    except BaseException:
        os.close(dir_fd)
        raise


def _dtype(value: Any) -> torch.dtype:
    return value.metadata().tensor_properties.dtype if hasattr(value, "metadata") else value.dtype


def _check_entries(template: Dict[str, Any], directory: Path, metadata: Metadata) -> None:
    """Every key must be a tensor in the checkpoint with the model's global shape and dtype."""
    saved = metadata.state_dict_metadata
    for section, entries in template.items():
        for key, value in entries.items():
            full_key = f"{section}.{key}"
            meta = saved.get(full_key)
            if not isinstance(meta, TensorStorageMetadata):
                raise ValueError(
                    f"checkpoint {directory}: no {describe_key(key)} ({section}) in it"
                )
            saved_size = tuple(meta.size)
            size = tuple(value.size())
            if saved_size != size:
                raise ValueError(
                    f"checkpoint {directory}: {describe_key(key)} ({section}) has shape "
                    f"{saved_size} in the checkpoint but {size} in the model"
                )
            if meta.properties.dtype != _dtype(value):
                raise ValueError(
                    f"checkpoint {directory}: {describe_key(key)} ({section}) has dtype "
                    f"{meta.properties.dtype} in {MANIFEST} but {_dtype(value)} in the model"
                )


def _check_no_extra_keys(template: Dict[str, Any], directory: Path, metadata: Metadata) -> None:
    """strict: every model key in the checkpoint must be in the model (nothing dropped)."""
    extra = sorted(
        full_key.split(".", 1)[1]
        for full_key in metadata.state_dict_metadata
        if full_key.startswith("model.") and full_key.split(".", 1)[1] not in template["model"]
    )
    if extra:
        shown = ", ".join(describe_key(k) for k in extra[:4]) + (" ..." if len(extra) > 4 else "")
        raise ValueError(
            f"checkpoint {directory}: {len(extra)} saved key(s) the model does not "
            f"have: {shown}; pass strict=False to load the rest"
        )


def _read_extra(opened: _Opened) -> Dict[str, Any]:
    directory = opened.directory
    try:
        data = read_small(opened.dir_fd, EXTRA, directory / EXTRA, EXTRA_LIMIT)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {directory}: {EXTRA} is missing") from None
    recorded = opened.manifest.extra
    if recorded is not None and (
        len(data) != recorded.size or hashlib.sha256(data).hexdigest() != recorded.sha256
    ):
        raise ValueError(
            f"checkpoint {directory}: {EXTRA} does not match its size and SHA-256 in {MANIFEST}"
        )
    try:
        extra = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(
            f"checkpoint {directory}: cannot read {EXTRA} ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(extra, dict):
        raise ValueError(
            f"checkpoint {directory}: {EXTRA} holds a {type(extra).__name__}, "
            f"not the JSON object save() wrote"
        )
    return extra


Identity = Tuple[str, str, str]  # (directory as this rank sees it, its name, manifest sha256)


def _agree(error: Exception | None, identity: Identity | None = None) -> None:
    """Every rank learns every rank's verdict (and which checkpoint each read) before the next
    collective, so a problem one rank found raises the same error on all of them."""
    verdict = None if error is None else (isinstance(error, FileNotFoundError), str(error))
    gathered: List[Tuple[Tuple[bool, str] | None, Identity | None]] = [(verdict, identity)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [(None, None)] * dist.get_world_size()
        dist.all_gather_object(gathered, (verdict, identity))
    for rank, (found, _) in enumerate(gathered):
        if found is not None:
            raise (FileNotFoundError if found[0] else ValueError)(
                f"{found[1]} (found by rank {rank})"
            )
    if len({ident[1:] for _, ident in gathered if ident is not None}) > 1:
        shown = "; ".join(
            f"rank {rank} reads {ident[0]} (manifest sha256 {ident[2][:12]})"
            for rank, (_, ident) in enumerate(gathered)
            if ident is not None
        )
        raise ValueError(
            f"ranks are loading different checkpoints: {shown}; every rank must load the "
            f"same one (the same path, and {LATEST} unchanged while they load)"
        )


def _entry_targets(
    template: Dict[str, Any], keys: Dict[str, Any], metadata: Metadata
) -> Dict[str, torch.Tensor]:
    """Entry state (`EntryState`: its length is a count of entries, e.g. a managed collision
    history) is read whole at its saved length: each such template entry is replaced by an
    empty tensor of the saved shape, which the modules load from after the copy-in (each keeps
    its own entries). Keys the checkpoint lacks stay, for `_check_entries` to report."""
    out: Dict[str, torch.Tensor] = {}
    for key in keys:
        meta = metadata.state_dict_metadata.get(f"model.{key}")
        if key in template and isinstance(meta, TensorStorageMetadata):
            out[key] = template[key] = torch.empty(
                meta.size, dtype=meta.properties.dtype, device="cpu"
            )
    return out


def _first_cause(error: BaseException) -> str:
    """The innermost error's last line (DCP nests rank tracebacks in its exception text)."""
    text = str(error).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


@quiet_sharded_tensor()
def load(
    path: str,
    model: nn.Module,
    optimizer: KeyedOptimizer | None = None,
    strict: bool = True,
    allow_non_finite: bool = False,
    key: bytes | str | None = None,
) -> Dict[str, Any]:
    """Load the newest checkpoint under `path` into `model` (and `optimizer`), resharding to the
    model's current plan and world size. Returns the `extra` dict given to `save`.

    Every model key must be in the checkpoint with the same dtype and shape; with `strict`
    (default), every model key in the checkpoint must also be in the model (as
    `load_state_dict`). NaN and infinite values are refused unless `allow_non_finite`. With a
    `key` (else `$RECSHARD_CHECKPOINT_KEY`) the manifest's HMAC must be valid. Nothing changes
    unless every rank read and checked everything; it needs memory for a second copy of this
    rank's model and optimizer state while it runs.

    Row-wise optimizer state saved under another column layout is converted
    (`checkpoint/column_state.py`): a row- or table-wise table gets the width-weighted mean of
    its saved column shards' accumulators (exact); a column shard gets the value of the saved
    block that covers it.
    """
    error: Exception | None = None
    identity: Identity | None = None
    opened: _Opened | None = None
    relayouts: List[Relayout] = []
    entries: Dict[str, torch.Tensor] = {}
    try:
        opened = _open_checkpoint(path, checkpoint_key(key))
        identity = (str(opened.directory), *opened.identity)
        template = _training_state(model, optimizer)
        entry_keys = entry_state_keys(get_unwrapped_module(model))
        entries = _entry_targets(template["model"], entry_keys, opened.manifest.metadata)
        if "fused_optim" in template:
            relayouts = plan_relayouts(
                template, opened.manifest.metadata, "fused_optim", opened.directory
            )
        _check_entries(template, opened.directory, opened.manifest.metadata)
        if strict:
            _check_no_extra_keys(template, opened.directory, opened.manifest.metadata)
        extra = _read_extra(opened)
    except (OSError, ValueError) as e:
        error = e
    try:
        _agree(error, identity)
        assert opened is not None  # no error on any rank: every rank opened it
        reader = StagingReader(opened.directory, opened.dir_fd, opened.manifest, allow_non_finite)
        try:
            dcp.load(template, storage_reader=reader)  # reads, checks and keeps; copies nothing
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise RuntimeError(
                f"loading checkpoint {opened.directory} failed; model and optimizer are "
                f"unchanged: {_first_cause(e)}"
            ) from e
        problem = reader.error
        if problem is None and entries:
            reader.copy_in(only=list(entries.values()))
            try:
                load_entries(entry_keys, entries, check_only=True)
            except ValueError as e:
                problem = f"checkpoint {opened.directory}: {e}"
        _agree(None if problem is None else ValueError(problem))
        reader.copy_in()
        for relayout in relayouts:
            relayout.finish()
        load_entries(entry_keys, entries)
    finally:
        if opened is not None:
            os.close(opened.dir_fd)
    return extra


def read_checkpoint(
    path: str, allow_non_finite: bool = False, key: bytes | str | None = None
) -> Dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint under `path`, assembled whole in this process (no
    process group), keyed `model.<key>`, `fused_optim.<key>`, `dense_optim.<key>`; checked
    as `load` checks it. For inspecting or converting a checkpoint."""
    opened = _open_checkpoint(path, checkpoint_key(key))
    try:
        state = {
            fqn: torch.empty(meta.size, dtype=meta.properties.dtype, device="cpu")
            for fqn, meta in opened.manifest.metadata.state_dict_metadata.items()
        }
        reader = StagingReader(opened.directory, opened.dir_fd, opened.manifest, allow_non_finite)
        dcp.load(state, storage_reader=reader, no_dist=True)
        if reader.error is not None:
            raise ValueError(reader.error)
        reader.copy_in()
        return state
    finally:
        os.close(opened.dir_fd)
