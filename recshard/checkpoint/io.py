"""Save and load sharded training state; load into any world size or plan.

Layout under `path`: one directory per save (`ckpt-<id>/`: shard files written by
`torch.distributed.checkpoint`, each rank its own, a `manifest.json` describing them, and
`extra.json`) and a `LATEST` file naming the newest complete one. `LATEST` may only name a
sibling directory. Nothing is ever unpickled: the manifest is JSON (see `manifest.py`).
`LATEST` is replaced atomically after every rank has finished writing, so a process killed
mid-save leaves the previous checkpoint loadable. The previous directory
is kept until the next save completes; a half-written one left by a killed save is removed
by the next save that completes.

`load` verifies everything before it touches the model: the manifest, that every key it needs
is in the checkpoint with the model's shape, every shard file's size and SHA-256 (the ranks
share the hashing), and `extra.json`. The ranks exchange their verdicts, so a problem any rank
finds raises the same error on every rank, naming the checkpoint directory, the file or table,
and both shapes or sizes; model and optimizer are then exactly as they were.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Set, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from recshard.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    ManifestReader,
    ManifestWriter,
    check_file,
    read_manifest,
)
from recshard.distributed.model_parallel import get_unwrapped_module
from recshard.distributed.sharded_state import (
    fused_optimizer_state,
    model_state_dict,
    quiet_sharded_tensor,
)
from recshard.optim.fused import FusedOptimizer
from recshard.optim.keyed import CombinedOptimizer, KeyedOptimizer

LATEST = "LATEST"


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
) -> str:
    """Write a checkpoint (collective: every rank calls it). Returns its directory."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    directory = root / _step("agreeing on a directory name (broadcast)", root, _shared_name)
    state = _training_state(model, optimizer)
    _step(
        "writing shards (torch.distributed.checkpoint)",
        directory,
        lambda: dcp.save(state, storage_writer=ManifestWriter(str(directory))),
    )
    _step("waiting for every rank to finish writing (barrier)", directory, _barrier)
    if _rank() == 0:
        _write_durably(directory / "extra.json", json.dumps(extra or {}))
        _fsync_directory(directory)
        previous = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
        tmp = root / f"{LATEST}.tmp"
        _write_durably(tmp, directory.name)
        os.replace(tmp, root / LATEST)  # the commit point
        _fsync_directory(root)
        for stale in root.glob("ckpt-*"):
            if stale.name not in (directory.name, previous):
                shutil.rmtree(stale, ignore_errors=True)
    _step("waiting for rank 0 to commit LATEST (barrier)", directory, _barrier, committed=True)
    return str(directory)


def _write_durably(file: Path, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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


def latest_checkpoint(path: str) -> Path:
    """The directory `LATEST` names; it must be a sibling of `LATEST` (a plain name, no
    path), so write access to `LATEST` alone cannot point `load` anywhere else."""
    root = Path(path)
    pointer = root / LATEST
    if not pointer.exists():
        raise FileNotFoundError(f"no complete checkpoint under {root} (no {LATEST} file)")
    try:
        name = pointer.read_bytes().decode("ascii").strip()
    except UnicodeDecodeError:
        name = ""
    if not _DIRECTORY_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(
            f"{pointer}: must hold the name of a checkpoint directory beside it "
            f"(like 'ckpt-0123456789ab'), not {pointer.read_bytes()[:60]!r}"
        )
    directory = root / name
    if not directory.is_dir() or directory.resolve().parent != root.resolve():
        raise ValueError(f"{pointer}: names {name!r}, which is not a directory beside it")
    if not (directory / MANIFEST).exists():
        older = (
            " (written by an older recshard, whose pickled .metadata is no longer read)"
            if (directory / ".metadata").exists()
            else ""
        )
        raise ValueError(
            f"checkpoint {directory} is incomplete or truncated (no {MANIFEST}){older}"
        )
    return directory


_TABLE_KEY = re.compile(r"(?:embedding_bags|embeddings)\.([^.]+)\.")


def _describe_key(key: str) -> str:
    """`table 't0' ('ebc.embedding_bags.t0.weight')` for table keys, else the quoted key."""
    match = _TABLE_KEY.search(key)
    return f"table '{match.group(1)}' ('{key}')" if match else f"'{key}'"


def _check_shapes(template: Dict[str, Any], directory: Path, metadata: Any) -> None:
    """Every key must exist in the checkpoint with the same global shape."""
    saved = metadata.state_dict_metadata
    for section, entries in template.items():
        for key, value in entries.items():
            full_key = f"{section}.{key}"
            if full_key not in saved:
                raise ValueError(
                    f"checkpoint {directory}: no {_describe_key(key)} ({section}) in it"
                )
            saved_size = tuple(getattr(saved[full_key], "size", ()))
            size = tuple(value.size())
            if saved_size != size:
                raise ValueError(
                    f"checkpoint {directory}: {_describe_key(key)} ({section}) has shape "
                    f"{saved_size} in the checkpoint but {size} in the model"
                )


def _check_no_extra_keys(template: Dict[str, Any], directory: Path, metadata: Any) -> None:
    """strict: every model key in the checkpoint must be in the model (nothing dropped)."""
    extra = sorted(
        full_key.split(".", 1)[1]
        for full_key in metadata.state_dict_metadata
        if full_key.startswith("model.") and full_key.split(".", 1)[1] not in template["model"]
    )
    if extra:
        shown = ", ".join(_describe_key(k) for k in extra[:4]) + (" ..." if len(extra) > 4 else "")
        raise ValueError(
            f"checkpoint {directory}: {len(extra)} saved key(s) the model does not "
            f"have: {shown}; pass strict=False to load the rest"
        )


def _check_files(template: Dict[str, Any], directory: Path, manifest: Manifest) -> None:
    """This rank's share of the shard files (every world-size-th, by name) exists with the
    size and SHA-256 the manifest records; the ranks exchange verdicts afterwards."""
    wanted: Set[str] = {
        f"{section}.{key}" for section, entries in template.items() for key in entries
    }
    holds: Dict[str, Set[str]] = defaultdict(set)
    for index, info in manifest.metadata.storage_data.items():
        if index.fqn in wanted:
            holds[info.relative_path].add(index.fqn.split(".", 1)[1])
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    for name in sorted(manifest.files)[_rank() :: world_size]:
        try:
            check_file(directory, name, manifest.files[name])
        except ValueError as e:
            keys = sorted(holds[name])
            shown = ", ".join(_describe_key(k) for k in keys[:4]) + (
                " ..." if len(keys) > 4 else ""
            )
            raise ValueError(
                f"checkpoint {directory}: {e}" + (f" (it holds {shown})" if keys else "")
            ) from None


def _read_extra(directory: Path) -> Dict[str, Any]:
    file = directory / "extra.json"
    try:
        extra = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(
            f"checkpoint {directory}: cannot read extra.json ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(extra, dict):
        raise ValueError(
            f"checkpoint {directory}: extra.json holds a {type(extra).__name__}, "
            f"not the JSON object save() wrote"
        )
    return extra


def _agree(error: Exception | None) -> None:
    """Every rank learns every rank's verdict before any collective of the load starts, so
    a problem one rank found raises the same error on all of them (nothing hangs)."""
    verdict = None if error is None else (isinstance(error, FileNotFoundError), str(error))
    verdicts: List[Tuple[bool, str] | None] = [verdict]
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, verdict)
    first = next((v for v in verdicts if v is not None), None)
    if first is not None:
        raise (FileNotFoundError if first[0] else ValueError)(first[1])


def _verify(
    template: Dict[str, Any], directory: Path, strict: bool
) -> Tuple[Manifest, Dict[str, Any]]:
    """Everything a load reads, checked before it touches the model (this rank's part)."""
    manifest = read_manifest(directory)
    _check_shapes(template, directory, manifest.metadata)
    if strict:
        _check_no_extra_keys(template, directory, manifest.metadata)
    _check_files(template, directory, manifest)
    return manifest, _read_extra(directory)


def _first_cause(error: BaseException) -> str:
    """The innermost error's last line (DCP nests rank tracebacks in its exception text)."""
    text = str(error).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


@quiet_sharded_tensor()
def load(
    path: str, model: nn.Module, optimizer: KeyedOptimizer | None = None, strict: bool = True
) -> Dict[str, Any]:
    """Load the newest checkpoint under `path` into `model` (and `optimizer`), resharding to the
    model's current plan and world size. Returns the `extra` dict given to `save`.

    Every model key must be in the checkpoint with the same shape; with `strict` (default),
    every model key in the checkpoint must also be in the model (as `load_state_dict`).
    """
    error: Exception | None = None
    try:
        directory = latest_checkpoint(path)
        template = _training_state(model, optimizer)
        manifest, extra = _verify(template, directory, strict)
    except (OSError, ValueError) as e:
        error = e
    _agree(error)
    try:
        dcp.load(template, storage_reader=ManifestReader(directory, manifest))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise RuntimeError(
            f"loading checkpoint {directory} failed after it was verified; the "
            f"model may be partly loaded: {_first_cause(e)}"
        ) from e
    with torch.no_grad():  # DCP may replace plain tensors instead of copying into them
        live = _training_state(model, optimizer)
        for section, entries in template.items():
            for key, value in entries.items():
                target = live[section][key]
                if (
                    isinstance(value, torch.Tensor)
                    and not hasattr(value, "local_shards")
                    and value.data_ptr() != target.data_ptr()
                ):
                    target.copy_(value)
    return extra
