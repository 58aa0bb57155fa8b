"""`Batch`es from preprocessed Criteo arrays (see `preprocess.py`), memory-mapped.

A split's rows are its parts' rows in file order. With `world_size` readers, each reads its
own contiguous slice of `rows // world_size` rows (every rank gets as many batches; the few
rows past the last full slice are not read). Without shuffling, batches are the rows in
order, exactly what the TSV reader yields for the same rows on one reader. With
`shuffle_buffer` rows, the slice is cut into buffers of that many rows (a multiple of the
batch size); the buffers are visited in a random order and each one's rows are permuted,
seeded by `(seed, epoch, rank)`, so an epoch reads each row once with only one buffer in memory.
"""

from __future__ import annotations

import os
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import torch

from examples.dlrm.data.criteo_spec import NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from examples.dlrm.data.preprocess import MANIFEST, SPLITS, Manifest, part_path
from recshard import KeyedJaggedTensor
from recshard.datasets.utils import Batch


def is_preprocessed(path: str | None) -> bool:
    """Whether `path` is a directory written by `python -m examples.dlrm.preprocess`."""
    return bool(path) and os.path.isfile(os.path.join(path, MANIFEST))


class SplitArrays:
    """A split's labels `[N]`, dense `[N, 13]` and ids `[N, 26]` over all parts, memory-mapped."""

    def __init__(self, directory: str, manifest: Manifest, split: str) -> None:
        splits = SPLITS if split == "all" else (split,)
        if split != "all" and split not in SPLITS:
            raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
        self.parts: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for part in manifest.parts:
            for s in splits:
                rows = part.rows(s)
                if rows == 0:
                    continue
                self.parts.append(
                    (
                        _map(part_path(directory, part.name, s, "labels"), np.uint8, (rows,)),
                        _map(
                            part_path(directory, part.name, s, "dense"),
                            np.float32,
                            (rows, NUM_DENSE),
                        ),
                        _map(
                            part_path(directory, part.name, s, "ids"),
                            np.dtype(manifest.id_dtype),
                            (rows, NUM_SPARSE),
                        ),
                    )
                )
        self.starts = np.cumsum([0] + [p[0].shape[0] for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows `[start, stop)` as in-memory (labels, dense, ids) arrays."""
        pieces = []
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for index in range(first, len(self.parts)):
            base = int(self.starts[index])
            if base >= stop:
                break
            lo, hi = max(start - base, 0), min(stop, int(self.starts[index + 1])) - base
            pieces.append(tuple(a[lo:hi] for a in self.parts[index]))
        if len(pieces) == 1:
            return tuple(np.array(a) for a in pieces[0])  # type: ignore[return-value]
        return tuple(np.concatenate(a) for a in zip(*pieces))  # type: ignore[return-value]


def _map(path: str, dtype: np.dtype, shape: Tuple[int, ...]) -> np.ndarray:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if os.path.getsize(path) != expected:
        raise ValueError(
            f"{path}: {os.path.getsize(path)} bytes, the manifest says {shape} "
            f"{np.dtype(dtype).name} ({expected} bytes); preprocess again"
        )
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def make_batch(
    labels: np.ndarray, dense: np.ndarray, ids: np.ndarray, keys: Sequence[str] = SPARSE_NAMES
) -> Batch:
    """Rows -> Batch, one id per feature (a KJT with all lengths 1, feature-major values)."""
    batch_size = labels.shape[0]
    values = torch.from_numpy(np.ascontiguousarray(ids.T)).reshape(-1).to(torch.int64)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        list(keys), values, torch.ones(len(keys) * batch_size, dtype=torch.int32)
    )
    return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels).to(torch.int64))


class BinaryCriteo:
    """This rank's `Batch`es of one split of a preprocessed directory, one epoch per iteration.

    `shuffle_buffer` rows (0: no shuffling) are permuted at a time; `epoch` changes the order.
    """

    def __init__(
        self,
        directory: str,
        batch_size: int,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 0,
        seed: int = 0,
        epoch: int = 0,
    ) -> None:
        if batch_size < 1 or shuffle_buffer < 0:
            raise ValueError(
                f"batch_size must be >= 1 and shuffle_buffer >= 0, got "
                f"{batch_size}, {shuffle_buffer}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.manifest = Manifest.load(directory)
        self.arrays = SplitArrays(directory, self.manifest, split)
        per_rank = len(self.arrays) // world_size
        self.start = rank * per_rank
        self.num_batches = per_rank // batch_size
        self.batch_size = batch_size
        buffer_batches = max(shuffle_buffer // batch_size, 1)
        self.buffer_rows = buffer_batches * batch_size
        self.shuffle = shuffle_buffer > 0
        self.seed, self.epoch, self.rank = seed, epoch, rank

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        end = self.start + self.num_batches * self.batch_size
        buffers = np.arange(self.start, end, self.buffer_rows)
        rng = np.random.default_rng((self.seed, self.epoch, self.rank))
        if self.shuffle:
            buffers = rng.permutation(buffers)
        for first in buffers.tolist():
            labels, dense, ids = self.arrays.read(first, min(first + self.buffer_rows, end))
            if self.shuffle:
                order = rng.permutation(labels.shape[0])
                labels, dense, ids = labels[order], dense[order], ids[order]
            for lo in range(0, labels.shape[0], self.batch_size):
                hi = lo + self.batch_size
                yield make_batch(labels[lo:hi], dense[lo:hi], ids[lo:hi])
