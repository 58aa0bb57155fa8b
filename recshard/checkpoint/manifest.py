"""A checkpoint's metadata as data: `manifest.json` instead of DCP's pickled `.metadata`.

`torch.distributed.checkpoint` describes a checkpoint (which tensors, their global shapes and
chunks, where each chunk's bytes lie) in a `Metadata` object that its file writer pickles and
its file reader unpickles: loading a checkpoint from an untrusted place would run any code
planted in that file. recshard writes the same description as JSON, with every shard file's
and `extra.json`'s size and SHA-256 (and, with a key, an HMAC: `authenticity.py`), and rebuilds
`Metadata` from it on load. A manifest holds tensors only: DCP reads a *bytes* entry with
an unrestricted `torch.load`, so a manifest that declares one is refused.

`ManifestWriter` is DCP's file writer with only the metadata step replaced. `parse_manifest`
parses strictly: any malformed entry, a chunk list that does not tile its tensor, or a storage
entry for no chunk raises `ValueError` naming the file and the JSON path of the entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from recshard.checkpoint import authenticity

MANIFEST = "manifest.json"
EXTRA = "extra.json"
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
    """A parsed `manifest.json`: DCP's metadata, the shard files it points into, and
    `extra.json` (None in manifests written before it was recorded)."""

    metadata: Metadata
    files: Dict[str, FileInfo]
    extra: FileInfo | None


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


def _file_info(path: Path) -> Dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def manifest_json(metadata: Metadata, directory: Path, key: bytes | None) -> Dict[str, Any]:
    """The JSON form of `metadata`, with the size and SHA-256 of every file it points into and
    of `extra.json`, signed with `key` if one is given."""
    tensors: Dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(
                f"'{fqn}' is not a tensor ({type(meta).__name__}); recshard checkpoints hold "
                f"tensors only (a non-tensor entry would have to be unpickled on load)"
            )
        tensors[fqn] = _tensor_entry(meta)
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
    planner_data = {name: list(path) for name, path in (metadata.planner_data or {}).items()}
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "tensors": tensors,
        "bytes": [],
        "storage": storage,
        "files": {name: _file_info(directory / name) for name in names},
        "extra": _file_info(directory / EXTRA),
        "planner_data": planner_data,
    }
    if key is not None:
        doc[authenticity.FIELD] = authenticity.sign(doc, key)
    return doc


def write_durably(file: Path, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class ManifestWriter(FileSystemWriter):
    """DCP's file writer, but the coordinator writes `extra.json` and then `manifest.json`
    (never a pickle), signed with `key` if one is given."""

    def __init__(self, path: str, extra_text: str, key: bytes | None) -> None:
        super().__init__(path)
        self._extra_text = extra_text
        self._key = key

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for per_rank in results for r in per_rank}
        directory = Path(self.path)
        write_durably(directory / EXTRA, self._extra_text)
        tmp = directory / f"{MANIFEST}.tmp"
        write_durably(tmp, json.dumps(manifest_json(metadata, directory, self._key)))
        os.rename(tmp, directory / MANIFEST)  # atomic on POSIX, as os.replace


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


def _check_tiling(p: _Parser, where: str, size: Tuple[int, ...], chunks: List[Any]) -> None:
    """The chunks cover the tensor exactly once (a gap would leave values unloaded)."""
    volume = sum(math.prod(c.sizes) for c in chunks)
    if volume != math.prod(size):
        raise p.fail(
            where, f"its chunks hold {volume} values, its size {list(size)} needs {math.prod(size)}"
        )
    ordered = sorted(chunks, key=lambda c: tuple(c.offsets))
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if size and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break  # sorted by offset: no later chunk reaches back into `a`
            if all(
                bo < ao + an and ao < bo + bn
                for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes)
            ):
                raise p.fail(where, f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap")


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
    _check_tiling(p, where, size, chunks)
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), chunks)


def _storage(
    p: _Parser,
    entries: List[Any],
    files: Dict[str, FileInfo],
    tensors: Dict[str, TensorStorageMetadata],
) -> Dict[MetadataIndex, StorageInfo]:
    """Where each chunk's bytes lie: exactly one entry per chunk of every tensor."""
    out: Dict[MetadataIndex, StorageInfo] = {}
    for i, entry in enumerate(entries):
        at = f"storage[{i}]"
        fqn = p.get(entry, "fqn", at, str)
        offset = p.ints(p.get(entry, "offset", at, list), f"{at}.offset")
        index = p.get(entry, "index", at, int, optional=True)
        if fqn not in tensors or offset not in {tuple(c.offsets) for c in tensors[fqn].chunks}:
            raise p.fail(at, f"no chunk of a tensor {fqn!r:.80} at {list(offset)}")
        name = p.get(entry, "file", at, str)
        if name not in files:
            raise p.fail(f"{at}.file", f"{name!r:.60} is not among the listed files")
        start = p.get(entry, "file_offset", at, int)
        length = p.get(entry, "length", at, int)
        if start < 0 or length < 0 or start + length > files[name].size:
            raise p.fail(
                at, f"bytes {start}..{start + length} lie outside {name} ({files[name].size} bytes)"
            )
        if p.get(entry, "transforms", at, list, optional=True):
            raise p.fail(f"{at}.transforms", "recshard writes and reads untransformed bytes only")
        key = MetadataIndex(fqn, offset, index)
        if key in out:
            raise p.fail(at, f"a second entry for {fqn!r:.80} at {list(offset)}")
        out[key] = StorageInfo(name, start, length, None)
    for fqn, meta in tensors.items():
        for chunk in meta.chunks:
            if MetadataIndex(fqn, tuple(chunk.offsets)) not in out:
                raise p.fail(
                    "storage", f"no entry for {fqn!r:.80}'s chunk at {list(chunk.offsets)}"
                )
    return out


def _file_entry(p: _Parser, entry: Any, at: str) -> FileInfo:
    size = p.get(entry, "size", at, int)
    digest = p.get(entry, "sha256", at, str)
    if size < 0 or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise p.fail(at, f"bad size {size} or sha256 {digest!r:.70}")
    return FileInfo(size, digest)


def _files(p: _Parser, entries: Dict[str, Any]) -> Dict[str, FileInfo]:
    files: Dict[str, FileInfo] = {}
    for name, entry in entries.items():
        at = f"files[{name!r:.60}]"
        if Path(name).name != name or name in (".", "..", MANIFEST, EXTRA):
            raise p.fail(at, "a shard file must be a plain file name in the checkpoint directory")
        files[name] = _file_entry(p, entry, at)
    return files


def parse_manifest(data: bytes, file: Path, key: bytes | None) -> Manifest:
    """Parse the bytes of `file` (a `manifest.json`) into DCP metadata; with a `key`, its HMAC
    must be valid. `ValueError` naming the file and the JSON path on anything malformed."""
    p = _Parser(file)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(
            f"{file}: not a recshard checkpoint manifest (not UTF-8 JSON: {type(e).__name__}: {e})"
        ) from None
    if p.get(doc, "format", "$", str) != FORMAT or p.get(doc, "version", "$", int) != VERSION:
        raise p.fail(
            "$",
            f"format {doc.get('format')!r:.40} version {doc.get('version')!r:.20}; "
            f"this recshard reads {FORMAT!r} version {VERSION}",
        )
    if key is not None:
        authenticity.verify(doc, key, file)
    files = _files(p, p.get(doc, "files", "$", dict))
    extra = p.get(doc, "extra", "$", dict, optional=True)
    for i, fqn in enumerate(p.get(doc, "bytes", "$", list)):
        raise p.fail(
            f"bytes[{i}]",
            f"{fqn!r:.80} is a bytes entry; recshard checkpoints hold tensors only and never "
            f"unpickle (DCP would unpickle it with an unrestricted torch.load)",
        )
    tensors = {
        fqn: _tensor_meta(p, entry, f"tensors[{fqn!r:.80}]")
        for fqn, entry in p.get(doc, "tensors", "$", dict).items()
    }
    storage = _storage(p, p.get(doc, "storage", "$", list), files, tensors)
    planner_data = {}
    for name, path in p.get(doc, "planner_data", "$", dict).items():
        if not isinstance(path, list) or not all(isinstance(x, (str, int)) for x in path):
            raise p.fail(f"planner_data[{name!r:.60}]", "expected a list of keys")
        planner_data[name] = tuple(path)
    metadata = Metadata(dict(tensors), planner_data=planner_data, storage_data=storage)
    return Manifest(metadata, files, None if extra is None else _file_entry(p, extra, "extra"))
