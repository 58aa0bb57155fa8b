"""Train and eval batch streams for the CLI, and a guard that keeps ranks in step."""

from __future__ import annotations

import argparse
import itertools
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from examples.dlrm.data.binary import BinaryCriteo, is_preprocessed
from examples.dlrm.data.criteo import criteo_loader, list_files
from examples.dlrm.data.synthetic import SyntheticConfig, SyntheticCriteo
from recshard.datasets.utils import Batch


def _pin() -> bool:
    """Pinned host batches on GPU machines (the pipeline copies them asynchronously)."""
    return torch.cuda.is_available()


def _pinned(batches: Iterable[Batch]) -> Iterator[Batch]:
    """Preprocessed batches, pinned on GPU machines as the DataLoader pins the TSV reader's."""
    pin = _pin()
    return (batch.pin_memory() if pin else batch for batch in batches)


def synthetic_config(args: argparse.Namespace) -> SyntheticConfig:
    return SyntheticConfig(
        num_embeddings_per_feature=args.num_embeddings_per_feature,
        batch_size=args.batch_size,
        multi_hot=args.multi_hot,
        zipf_alpha=args.zipf_alpha,
        seed=args.seed,
    )


class RankSynced:
    """Stops every rank as soon as one rank's iterator is exhausted.

    Ranks may hold different numbers of batches (files split unevenly); a rank that stops
    while the others enter a collective would hang them. Each `next` all-reduces a
    "have a batch" flag (MIN) on `group`, a gloo group of its own so it never interleaves
    with the model's collectives. (recshard's pipelines vote the same way; stopping here
    first makes every rank end on the same batch without their "ran out" warnings.)
    """

    def __init__(self, iterable: Iterable[Batch], group: Any | None) -> None:
        self._iterator = iter(iterable)
        self._group = group
        self._done = False

    def __iter__(self) -> RankSynced:
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        batch = next(self._iterator, None)
        if self._group is not None:
            flag = torch.tensor([0 if batch is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
            if int(flag) == 0:
                batch = None
        if batch is None:
            self._done = True
            raise StopIteration
        return batch


def train_batches(
    args: argparse.Namespace, rank: int, world_size: int, start_step: int, group: Any | None
) -> Iterator[Batch]:
    """The training stream from `start_step` on: `--steps` batches (synthetic, or Criteo
    cycled over), else `--epochs` passes over the Criteo train split."""
    if args.data == "synthetic":
        remaining = max(args.steps - start_step, 0)
        return iter(SyntheticCriteo(synthetic_config(args), rank, "train", remaining, start_step))
    split = "all" if args.eval_data_path else "train"
    binary = is_preprocessed(args.data_path)
    files = [] if binary else list_files(args.data_path)

    def one_pass(epoch: int) -> Iterable[Batch]:
        if binary:
            return _pinned(
                BinaryCriteo(
                    args.data_path,
                    args.batch_size,
                    split,
                    rank,
                    world_size,
                    args.shuffle_buffer,
                    args.seed,
                    epoch,
                )
            )
        return criteo_loader(
            args.data_path,
            args.num_embeddings_per_feature,
            args.batch_size,
            rank,
            world_size,
            split,
            args.num_workers,
            pin_memory=_pin(),
            files=files,
        )

    def passes() -> Iterator[Batch]:
        epochs = itertools.count() if args.steps is not None else range(args.epochs)
        for epoch in epochs:
            produced = 0
            for batch in one_pass(epoch):
                produced += 1
                yield batch
            if produced == 0:  # too little data for one batch: do not cycle forever
                return

    stream = itertools.islice(passes(), start_step, args.steps)
    return RankSynced(stream, group)


def eval_batches(
    args: argparse.Namespace, rank: int, world_size: int, group: Any | None
) -> Iterator[Batch]:
    """The eval stream: fixed synthetic eval batches, or the Criteo eval split/files."""
    if args.data == "synthetic":
        return iter(SyntheticCriteo(synthetic_config(args), rank, "eval", args.eval_batches))
    path = args.eval_data_path or args.data_path
    split = "all" if args.eval_data_path else "eval"
    limit = args.eval_batches or None
    if is_preprocessed(path):
        binary = BinaryCriteo(path, args.batch_size, split, rank, world_size)
        return RankSynced(itertools.islice(_pinned(binary), limit), group)
    loader = criteo_loader(
        path,
        args.num_embeddings_per_feature,
        args.batch_size,
        rank,
        world_size,
        split,
        args.num_workers,
        pin_memory=_pin(),
    )
    return RankSynced(itertools.islice(loader, limit), group)
