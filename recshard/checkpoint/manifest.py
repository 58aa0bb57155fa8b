"""A checkpoint's metadata as data: `manifest.json` instead of DCP's pickled `.metadata`.

`torch.distributed.checkpoint` describes a checkpoint (which tensors, their global shapes and
chunks, where each chunk's bytes lie) in a `Metadata` object that its file writer pickles and
its file reader unpickles: loading a checkpoint from an untrusted place would run any code
planted in that file. recshard writes the same description as JSON, with every shard file's
size and SHA-256, and rebuilds `Metadata` from it on load; nothing of a checkpoint is ever
unpickled (shard files go through `torch.load(weights_only=True)`, and only after their
checksum matched).

`ManifestWriter` / `ManifestReader` are DCP's file writer and reader with only the metadata
step replaced. `read_manifest` parses strictly: any malformed entry raises `ValueError`
naming the file and the JSON path of the entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

MANIFEST = "manifest.json"
FORMAT = "recshard-checkpoint"
VERSION = 1
_CHUNK = 1 << 20


@dataclass(frozen=True)
class StorageInfo:
    """Where one chunk's bytes lie (the fields DCP's file reader uses)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None


@dataclass(frozen=True)
class FileInfo:
    """One shard file as written: its size in bytes and SHA-256."""

    size: int
    sha256: str


@dataclass
class Manifest:
    """A parsed `manifest.json`: DCP's metadata and the shard files it points into."""

    metadata: Metadata
    files: Dict[str, FileInfo]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _tensor_entry(meta: TensorStorageMetadata) -> Dict[str, Any]:
    return {
        "dtype": str(meta.properties.dtype).removeprefix("torch."),
        "size": list(meta.size),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in meta.chunks],
    }


def manifest_json(metadata: Metadata, directory: Path) -> Dict[str, Any]:
    """The JSON form of `metadata`, with the size and SHA-256 of every file it points into."""
    tensors: Dict[str, Any] = {}
    byte_keys: List[str] = []
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors[fqn] = _tensor_entry(meta)
        else:
            byte_keys.append(fqn)
    storage = []
    for index, info in metadata.storage_data.items():
        storage.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "file": info.relative_path,
                "file_offset": info.offset,
                "length": info.length,
                "transforms": list(info.transform_descriptors or []),
            }
        )
    names = sorted({entry["file"] for entry in storage})
    files = {
        name: {"size": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
        for name in names
    }
    planner_data = {key: list(path) for key, path in (metadata.planner_data or {}).items()}
    return {
        "format": FORMAT,
        "version": VERSION,
        "tensors": tensors,
        "bytes": byte_keys,
        "storage": storage,
        "files": files,
        "planner_data": planner_data,
    }


class ManifestWriter(FileSystemWriter):
    """DCP's file writer, but the coordinator writes `manifest.json`, never a pickle."""

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for per_rank in results for r in per_rank}
        directory = Path(self.path)
        text = json.dumps(manifest_json(metadata, directory))
        tmp = directory / f"{MANIFEST}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, directory / MANIFEST)  # atomic on POSIX, as os.replace


class ManifestReader(FileSystemReader):
    """DCP's file reader over metadata that `read_manifest` already parsed and checked."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        super().__init__(str(directory))
        self._manifest = manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._manifest.metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._manifest.metadata


class _Parser:
    """Strict JSON → typed values; every error names the file and the JSON path."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def fail(self, where: str, what: str) -> ValueError:
        return ValueError(f"{self.file}: {where}: {what}")

    def get(self, obj: Any, key: str, where: str, kind: type, optional: bool = False) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(where, f"expected an object, got {type(obj).__name__}")
        if key not in obj:
            if optional:
                return None
            raise self.fail(where, f"missing '{key}'")
        value = obj[key]
        if value is None and optional:
            return None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(f"{where}.{key}", f"expected {kind.__name__}, got {value!r:.60}")
        return value

    def ints(self, value: Any, where: str) -> Tuple[int, ...]:
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        ):
            raise self.fail(where, f"expected a list of non-negative integers, got {value!r:.60}")
        return tuple(value)

    def dtype(self, name: str, where: str) -> torch.dtype:
        dtype = getattr(torch, name, None) if name.isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise self.fail(where, f"unknown dtype {name!r:.40}")
        return dtype


def _tensor_meta(p: _Parser, entry: Any, where: str) -> TensorStorageMetadata:
    dtype = p.dtype(p.get(entry, "dtype", where, str), f"{where}.dtype")
    size = p.ints(p.get(entry, "size", where, list), f"{where}.size")
    chunks = []
    for i, chunk in enumerate(p.get(entry, "chunks", where, list)):
        at = f"{where}.chunks[{i}]"
        offsets = p.ints(p.get(chunk, "offsets", at, list), f"{at}.offsets")
        sizes = p.ints(p.get(chunk, "sizes", at, list), f"{at}.sizes")
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + s > n for o, s, n in zip(offsets, sizes, size))
        ):
            raise p.fail(
                at,
                f"chunk at {list(offsets)} of size {list(sizes)} does not fit "
                f"the tensor's size {list(size)}",
            )
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), chunks)


def _storage(
    p: _Parser, entries: List[Any], files: Dict[str, FileInfo]
) -> Dict[MetadataIndex, StorageInfo]:
    out: Dict[MetadataIndex, StorageInfo] = {}
    for i, entry in enumerate(entries):
        at = f"storage[{i}]"
        fqn = p.get(entry, "fqn", at, str)
        offset = p.get(entry, "offset", at, list, optional=True)
        index = p.get(entry, "index", at, int, optional=True)
        name = p.get(entry, "file", at, str)
        if name not in files:
            raise p.fail(f"{at}.file", f"{name!r:.60} is not among the listed files")
        start = p.get(entry, "file_offset", at, int)
        length = p.get(entry, "length", at, int)
        if start < 0 or length < 0 or start + length > files[name].size:
            raise p.fail(
                at, f"bytes {start}..{start + length} lie outside {name} ({files[name].size} bytes)"
            )
        transforms = p.get(entry, "transforms", at, list, optional=True) or []
        if not all(isinstance(t, str) for t in transforms):
            raise p.fail(f"{at}.transforms", "expected a list of strings")
        key = MetadataIndex(fqn, None if offset is None else p.ints(offset, f"{at}.offset"), index)
        out[key] = StorageInfo(name, start, length, tuple(transforms) or None)
    return out


def _files(p: _Parser, entries: Dict[str, Any]) -> Dict[str, FileInfo]:
    files: Dict[str, FileInfo] = {}
    for name, entry in entries.items():
        at = f"files[{name!r:.60}]"
        if Path(name).name != name or name in (".", "..", MANIFEST):
            raise p.fail(at, "a shard file must be a plain file name in the checkpoint directory")
        size = p.get(entry, "size", at, int)
        digest = p.get(entry, "sha256", at, str)
        if size < 0 or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise p.fail(at, f"bad size {size} or sha256 {digest!r:.70}")
        files[name] = FileInfo(size, digest)
    return files


def read_manifest(directory: Path) -> Manifest:
    """Parse `directory/manifest.json` into DCP metadata; `ValueError` naming the file and the
    JSON path on anything malformed."""
    file = directory / MANIFEST
    p = _Parser(file)
    try:
        doc = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(
            f"{file}: not a recshard checkpoint manifest (not UTF-8 JSON: {e})"
        ) from None
    if p.get(doc, "format", "$", str) != FORMAT or p.get(doc, "version", "$", int) != VERSION:
        raise p.fail(
            "$",
            f"format {doc.get('format')!r:.40} version {doc.get('version')!r:.20}; "
            f"this recshard reads {FORMAT!r} version {VERSION}",
        )
    files = _files(p, p.get(doc, "files", "$", dict))
    state: Dict[str, Any] = {
        fqn: _tensor_meta(p, entry, f"tensors[{fqn!r:.80}]")
        for fqn, entry in p.get(doc, "tensors", "$", dict).items()
    }
    for i, fqn in enumerate(p.get(doc, "bytes", "$", list)):
        if not isinstance(fqn, str):
            raise p.fail(f"bytes[{i}]", "expected a string")
        state[fqn] = BytesStorageMetadata()
    storage = _storage(p, p.get(doc, "storage", "$", list), files)
    planner_data = {}
    for key, path in p.get(doc, "planner_data", "$", dict).items():
        if not isinstance(path, list) or not all(isinstance(x, (str, int)) for x in path):
            raise p.fail(f"planner_data[{key!r:.60}]", "expected a list of keys")
        planner_data[key] = tuple(path)
    return Manifest(Metadata(state, planner_data=planner_data, storage_data=storage), files)


def check_file(directory: Path, name: str, info: FileInfo) -> None:
    """The shard file exists with the size and SHA-256 the manifest records."""
    file = directory / name
    if not file.is_file():
        raise ValueError(f"shard file {name} is missing")
    size = file.stat().st_size
    if size != info.size:
        state = "truncated" if size < info.size else "longer than written"
        raise ValueError(
            f"shard file {name} is {state}: {size} bytes, the manifest says {info.size}"
        )
    if file_sha256(file) != info.sha256:
        raise ValueError(
            f"shard file {name} does not match its checksum (SHA-256 in "
            f"{MANIFEST}): its bytes changed after the save"
        )
