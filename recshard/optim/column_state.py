"""Row-wise optimizer state across column layouts.

A row-wise optimizer (row-wise Adagrad) keeps one value per row. A column-sharded table keeps
one per row per column shard, named `<state>@col<offset>` under the table's FQN; the shard
over columns [a, b) accumulates `mean(g[r, a:b] ** 2)` each step. So the whole row's
accumulator is exactly the width-weighted mean of its column shards' (`sum_k w_k m_k / D`),
and that is what a row-wise or table-wise layout gets from a column-wise one. The other way
round the split is not recorded: a column block inside one saved block takes that block's
value (from a row-wise layout: the row's value); a block that spans several saved blocks takes
their overlap-weighted mean.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, Iterable, Mapping, Sequence, Tuple, TypeVar

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

COLUMN_TAG = "@col"

Block = Tuple[int, int]  # (first column, width)
RowsOf = Callable[[int, int], torch.Tensor]  # (first row, rows) -> that block's values there
V = TypeVar("V")


def column_key(name: str, offset: int) -> str:
    """`momentum1@col4`: the state `name` of the column shard starting at column `offset`."""
    return f"{name}{COLUMN_TAG}{offset}"


def state_key(name: str, offset: int | None) -> str:
    """`column_key`, or `name` itself for a state that holds whole rows (`offset` None)."""
    return name if offset is None else column_key(name, offset)


def split_key(key: str) -> Tuple[str, int | None]:
    """`momentum1@col4` -> (`momentum1`, 4); a key without a column tag -> (key, None)."""
    name, tag, offset = key.rpartition(COLUMN_TAG)
    if not tag or not offset.isdigit():
        return key, None
    return name, int(offset)


# TorchRec's fused optimizer names a table's first state `<table>.momentum1` and the next
# after fbgemm's key for it (Adam's second moment: `exp_avg_sq`); recshard's kernels and its
# checkpoints say `momentum1`, `momentum2`.
_TORCHREC_NAMES = {"momentum2": "exp_avg_sq"}
_RECSHARD_NAMES = {v: k for k, v in _TORCHREC_NAMES.items()}


def torchrec_key(table: str, key: str) -> str:
    """`momentum1` (or `momentum1@col4`) of table `t0` as TorchRec's fused optimizer names it:
    `t0.momentum1` (`t0.momentum1@col4`)."""
    name, offset = split_key(key)
    return f"{table}.{state_key(_TORCHREC_NAMES.get(name, name), offset)}"


def recshard_key(table: str, key: str) -> str:
    """The inverse of `torchrec_key`; a key without the table's prefix (a state dict saved
    before recshard took TorchRec's names) is already recshard's."""
    if key.startswith(f"{table}."):
        key = key[len(table) + 1 :]
        name, offset = split_key(key)
        return state_key(_RECSHARD_NAMES.get(name, name), offset)
    return key


def by_state(entries: Mapping[str, V]) -> Dict[str, Dict[int | None, V]]:
    """`{"momentum1@col0": a, "momentum1@col2": b}` -> `{"momentum1": {0: a, 2: b}}`."""
    out: Dict[str, Dict[int | None, V]] = defaultdict(dict)
    for key, value in entries.items():
        name, offset = split_key(key)
        out[name][offset] = value
    return dict(out)


def column_blocks(offsets: Iterable[int | None], dim: int, what: str) -> Dict[int | None, Block]:
    """The column block each offset's key holds in a table of width `dim` (None: the whole
    row); together they must tile [0, dim)."""
    given = list(offsets)
    starts = sorted(0 if o is None else o for o in given)
    if not starts or starts[0] != 0 or len(set(starts)) != len(starts) or starts[-1] >= dim:
        raise ValueError(
            f"{what}: column offsets {starts} do not cut a table of width {dim} into blocks"
        )
    width = {start: end - start for start, end in zip(starts, starts[1:] + [dim])}
    return {o: (o or 0, width[o or 0]) for o in given}


def combine_rows(sources: Sequence[Tuple[Block, torch.Tensor]], target: Block) -> torch.Tensor:
    """One row-wise value per row `[rows]` for the column block `target`, from the values
    `[rows]` of the saved blocks: the one block that covers it, or the overlap-weighted mean
    of those it spans."""
    start, width = target
    parts = [
        (min(start + width, s + w) - max(start, s), values)
        for (s, w), values in sources
        if min(start + width, s + w) > max(start, s)
    ]
    if len(parts) == 1:
        return parts[0][1].clone()
    total = torch.zeros_like(parts[0][1])
    for overlap, values in parts:
        total += overlap * values
    return total / width


def fill_rows(target: ShardedTensor, block: Block, saved: Sequence[Tuple[Block, RowsOf]]) -> None:
    """Write every local shard `[rows]` of the ShardedTensor `target` (column block `block`)
    from the saved blocks' values for the same rows."""
    with torch.no_grad():
        for shard in target.local_shards():
            start, count = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
            sources = [(b, rows_of(start, count)) for b, rows_of in saved]
            shard.tensor.copy_(combine_rows(sources, block))
