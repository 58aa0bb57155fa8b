"""Staged loads: read and check every tensor before any of it reaches the model.

`StagingReader` is DCP's file reader with `read_data` replaced. DCP plans the reads against
the live state (so it reshards as usual), but each checked piece is kept beside the model
instead of being copied in: each shard file is opened as a regular file, its size and SHA-256
checked, and every chunk read through that descriptor with `torch.load(weights_only=True)`
must hold exactly the dtype and shape the manifest declares, and finite values unless allowed.
The first problem is kept in `error` (naming the key, the file and the byte range) instead of
raised, so the load still finishes its collectives and the ranks exchange verdicts; only when
every rank is content does `copy_in` touch the model. The pieces are as large as this rank's
part of the state: a load needs that much memory again while it runs.
"""

from __future__ import annotations

import io
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from recshard.checkpoint.files import ShardFile
from recshard.checkpoint.manifest import MANIFEST, Manifest

_TABLE_KEY = re.compile(r"(?:embedding_bags|embeddings)\.([^.]+)\.")


def describe_key(key: str) -> str:
    """`table 't0' ('ebc.embedding_bags.t0.weight')` for table keys, else the quoted key."""
    match = _TABLE_KEY.search(key)
    return f"table '{match.group(1)}' ('{key}')" if match else f"'{key}'"


def describe_fqn(fqn: str) -> str:
    """A flattened DCP key (`section.key`) as `describe_key` shows it, with its section."""
    section, _, key = fqn.partition(".")
    return f"{describe_key(key)} ({section})"


def _non_finite(tensor: torch.Tensor) -> int:
    """How many values are NaN or infinite. One pass of `aminmax` (it propagates NaN, and an
    infinity is the min or the max) answers the common all-finite case without a temporary."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return 0
    low, high = torch.aminmax(torch.view_as_real(tensor) if tensor.is_complex() else tensor)
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return 0
    return int((~torch.isfinite(tensor)).sum())


def _shown(size: Any) -> str:
    return str(tuple(size))


class StagingReader(FileSystemReader):
    """DCP's file reader over a parsed manifest that checks everything it reads and keeps it
    in `staged` for `copy_in`; the first problem lands in `error` (None if all was well)."""

    def __init__(
        self, directory: Path, dir_fd: int, manifest: Manifest, allow_non_finite: bool
    ) -> None:
        super().__init__(str(directory))
        self.directory = directory
        self.error: str | None = None
        self.staged: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (live place, checked piece)
        self._dir_fd = dir_fd
        self._manifest = manifest
        self._allow_non_finite = allow_non_finite

    def copy_in(self, only: List[torch.Tensor] | None = None) -> None:
        """Copy every checked piece into its place in the model (after all ranks agreed), or
        only the pieces of the tensors `only` (kept staged: a later full copy-in repeats
        them)."""
        storages = None if only is None else {t.untyped_storage().data_ptr() for t in only}
        with torch.no_grad():
            for target, piece in self.staged:
                if storages is None or target.untyped_storage().data_ptr() in storages:
                    target.copy_(piece)
        if only is None:
            self.staged = []

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._manifest.metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._manifest.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: Dict[str, List[ReadItem]] = defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        try:
            for name in sorted(per_file):
                self._read_file(name, per_file[name], planner)
        except ValueError as e:
            self.error = f"checkpoint {self.directory}: {e}"
        except OSError as e:
            self.error = f"checkpoint {self.directory}: reading failed ({e})"
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _holds(self, name: str) -> str:
        keys = sorted(
            {
                i.fqn.split(".", 1)[1]
                for i, s in self.storage_data.items()
                if s.relative_path == name
            }
        )
        shown = ", ".join(describe_key(k) for k in keys[:4]) + (" ..." if len(keys) > 4 else "")
        return f" (it holds {shown})" if keys else ""

    def _read_file(self, name: str, items: List[ReadItem], planner: LoadPlanner) -> None:
        info = self._manifest.files[name]
        try:
            shard = ShardFile(self._dir_fd, name, self.directory / name)
        except FileNotFoundError:
            raise ValueError(f"shard file {name} is missing{self._holds(name)}") from None
        with shard:
            if shard.size != info.size:
                state = "truncated" if shard.size < info.size else "longer than written"
                raise ValueError(
                    f"shard file {name} is {state}: {shard.size} bytes, the manifest says "
                    f"{info.size}{self._holds(name)}"
                )
            if shard.sha256() != info.sha256:
                raise ValueError(
                    f"shard file {name} does not match its checksum (SHA-256 in {MANIFEST}): "
                    f"its bytes changed after the save{self._holds(name)}"
                )
            for item in items:
                self._read_item(shard, item, planner)
            shard.check_unchanged()

    def _read_item(self, shard: ShardFile, item: ReadItem, planner: LoadPlanner) -> None:
        where = self.storage_data[item.storage_index]
        fqn = item.storage_index.fqn
        at = (
            f"{describe_fqn(fqn)} in shard file {shard.name} "
            f"(bytes {where.offset}..{where.offset + where.length})"
        )
        meta = self._manifest.metadata.state_dict_metadata[fqn]
        if item.type == LoadItemType.BYTE_IO or not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"{at}: not a tensor; recshard loads tensors only")
        chunk = next(c for c in meta.chunks if c.offsets == item.storage_index.offset)
        try:
            data = shard.read(where.offset, where.length)
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # any failure to parse (e.g. a refused pickle) is a bad entry
            raise ValueError(f"{at}: not a saved tensor ({type(e).__name__}: {e})") from None
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{at}: holds a {type(tensor).__name__}, not a tensor")
        if tensor.dtype != meta.properties.dtype:
            raise ValueError(
                f"{at}: holds {tensor.dtype} values, the manifest says {meta.properties.dtype}"
            )
        if tensor.size() != chunk.sizes:
            raise ValueError(
                f"{at}: has shape {_shown(tensor.size())} in the file, the manifest says "
                f"{_shown(chunk.sizes)}"
            )
        piece = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        if not self._allow_non_finite:
            bad = _non_finite(piece)
            if bad:
                raise ValueError(
                    f"{at}: {bad} of {piece.numel()} values are NaN or infinite (pass "
                    f"allow_non_finite=True to load them)"
                )
        target = planner.resolve_tensor(item).detach()
        if target.size() != piece.size() or target.dtype != piece.dtype:
            raise ValueError(
                f"{at}: a {piece.dtype} piece of shape {_shown(piece.size())} for a "
                f"{target.dtype} place of shape {_shown(target.size())} in the model"
            )
        # Keep only the piece (not the whole chunk it was cut from) until the copy-in.
        self.staged.append((target, piece if piece.numel() == tensor.numel() else piece.clone()))
