"""Read Criteo click logs (TSV as released, or CSV with a header) into `Batch`es.

A row is `label, I1..I13, C1..C26`; any field may be empty and trailing empty fields may be
missing altogether. Dense values become `log(1 + max(x, 0))` (missing -> 0). A categorical
value (8 hex digits) is hashed into its table: missing -> row 0, otherwise
`1 + int(value, 16) mod (num_embeddings - 1)`, so row 0 is the "missing" row.

Files are split over ranks (whole files when there are at least as many as readers, else
every reader takes every k-th line), then over the DataLoader's workers the same way. About
one line in `eval_every_n` forms the "eval" split: those whose hashed line index is 0 modulo
`eval_every_n` (hashed, so that readers taking every k-th line all get their share).
"""

from __future__ import annotations

import glob
import math
import os
import zlib
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from examples.dlrm.data.batch import make_kjt
from examples.dlrm.data.criteo_spec import NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from recshard.datasets.utils import Batch

NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
Row = Tuple[int, List[float], List[int]]


@dataclass(frozen=True)
class FileShard:
    """Lines `offset, offset + stride, ...` of one file."""

    path: str
    stride: int = 1
    offset: int = 0


def list_files(data_path: str) -> List[str]:
    """Files under a path: a file, a directory (its *.txt, *.tsv, *.csv, sorted) or a glob."""
    if os.path.isdir(data_path):
        files = [
            os.path.join(data_path, name)
            for name in sorted(os.listdir(data_path))
            if name.endswith((".txt", ".tsv", ".csv"))
        ]
    elif any(ch in data_path for ch in "*?["):
        files = sorted(glob.glob(data_path))
    else:
        files = [data_path] if os.path.isfile(data_path) else []
    if not files:
        raise ValueError(f"no Criteo files (.txt, .tsv, .csv) found at {data_path!r}")
    return files


def split_shards(shards: Sequence[FileShard], reader: int, num_readers: int) -> List[FileShard]:
    """This reader's part of `shards`: whole shards if there are enough, else every
    `num_readers`-th line of each."""
    if num_readers == 1:
        return list(shards)
    if len(shards) >= num_readers:
        return list(shards[reader::num_readers])
    return [FileShard(s.path, s.stride * num_readers, s.offset + reader * s.stride) for s in shards]


def category_code(value: str) -> int | None:
    """The integer behind a categorical value: its hex value, else its crc32; None if missing."""
    if not value:
        return None
    try:
        return int(value, 16)
    except ValueError:
        return zlib.crc32(value.encode())


def hash_category(value: str, num_embeddings: int) -> int:
    """Row of a categorical value: 0 when missing, else in [1, num_embeddings)."""
    code = category_code(value)
    if code is None or num_embeddings == 1:
        return 0
    return 1 + code % (num_embeddings - 1)


def parse_dense(value: str) -> float:
    """`log(1 + x)`, negatives clamped to 0, missing -> 0."""
    if not value:
        return 0.0
    return math.log1p(max(float(value), 0.0))


def parse_line(line: str, sep: str, num_embeddings: Sequence[int], where: str) -> Row:
    """One text line -> (label, 13 dense values, 26 row ids)."""
    fields = line.rstrip("\r\n").split(sep)
    if len(fields) > NUM_FIELDS:
        raise ValueError(f"{where}: {len(fields)} fields, a Criteo row has at most {NUM_FIELDS}")
    fields += [""] * (NUM_FIELDS - len(fields))
    try:
        label = int(float(fields[0]))
        dense = [parse_dense(v) for v in fields[1 : 1 + NUM_DENSE]]
    except ValueError as e:
        raise ValueError(f"{where}: bad label or dense value ({e})") from None
    if label not in (0, 1):
        raise ValueError(f"{where}: label must be 0 or 1, got {fields[0]!r}")
    ids = [hash_category(v, n) for v, n in zip(fields[1 + NUM_DENSE :], num_embeddings)]
    return label, dense, ids


def is_eval_line(index: int, eval_every_n: int) -> bool:
    """Whether line `index` of a file belongs to the eval split (about 1 in `eval_every_n`)."""
    return zlib.crc32(index.to_bytes(8, "little")) % eval_every_n == 0


def sniff(first_line: str) -> Tuple[str, bool]:
    """(separator, has_header) from a file's first line."""
    sep = "\t" if "\t" in first_line else ","
    head = first_line.split(sep, 1)[0].strip()
    try:
        float(head)
        return sep, False
    except ValueError:
        return sep, True


def read_rows(
    shard: FileShard, num_embeddings: Sequence[int], split: str = "all", eval_every_n: int = 10
) -> Iterator[Row]:
    """Parsed rows of one file shard; `split` is "train", "eval" or "all"."""
    with open(shard.path, encoding="utf-8") as f:
        first = f.readline()
        if not first:
            return
        sep, header = sniff(first)
        lines = f if header else _chain(first, f)
        for index, line in enumerate(lines):
            if index % shard.stride != shard.offset or not line.strip():
                continue
            is_eval = is_eval_line(index, eval_every_n)
            if (split == "train" and is_eval) or (split == "eval" and not is_eval):
                continue
            line_no = index + 1 + int(header)
            yield parse_line(line, sep, num_embeddings, f"{shard.path}:{line_no}")


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


class CriteoIterDataset(IterableDataset):
    """Rows of this rank's share of the files (and of this DataLoader worker's share)."""

    def __init__(
        self,
        files: Sequence[str],
        num_embeddings_per_feature: Sequence[int],
        rank: int = 0,
        world_size: int = 1,
        split: str = "all",
        eval_every_n: int = 10,
    ) -> None:
        super().__init__()
        if len(num_embeddings_per_feature) != NUM_SPARSE:
            raise ValueError(
                f"Criteo has {NUM_SPARSE} categorical features, got "
                f"{len(num_embeddings_per_feature)} table sizes"
            )
        if split not in ("train", "eval", "all"):
            raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
        self.shards = split_shards([FileShard(p) for p in files], rank, world_size)
        self.num_embeddings = list(num_embeddings_per_feature)
        self.split = split
        self.eval_every_n = eval_every_n

    def __iter__(self) -> Iterator[Row]:
        info = get_worker_info()
        shards = (
            self.shards if info is None else split_shards(self.shards, info.id, info.num_workers)
        )
        for shard in shards:
            yield from read_rows(shard, self.num_embeddings, self.split, self.eval_every_n)


def collate_rows(rows: List[Row], keys: Sequence[str] = SPARSE_NAMES) -> Batch:
    """Rows -> Batch with one id per feature (lengths all 1)."""
    labels = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    dense = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    ids = torch.tensor([r[2] for r in rows], dtype=torch.int64)  # [B, 26]
    batch_size = len(rows)
    sparse = make_kjt(
        list(keys),
        [ids[:, f] for f in range(len(keys))],
        [torch.ones(batch_size, dtype=torch.int32)] * len(keys),
    )
    return Batch(dense, sparse, labels)


def criteo_loader(
    data_path: str,
    num_embeddings_per_feature: Sequence[int],
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    split: str = "all",
    num_workers: int = 2,
    eval_every_n: int = 10,
    pin_memory: bool = False,
    files: Sequence[str] | None = None,
) -> DataLoader:
    """A DataLoader of `Batch`es (`batch_size` rows each, last partial batch dropped)."""
    dataset = CriteoIterDataset(
        files or list_files(data_path),
        num_embeddings_per_feature,
        rank,
        world_size,
        split,
        eval_every_n,
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=collate_rows,
        drop_last=True,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=4 if num_workers > 0 else None,
    )
