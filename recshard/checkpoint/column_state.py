"""Load row-wise optimizer state that was saved under another column layout.

DCP reshards a tensor between plans by reading the overlapping regions of the same key. A
row-wise state changes its keys with the column layout (`momentum1` for a row- or table-wise
table, `momentum1@col<offset>` per column shard: `recshard.optim.column_state`), so for such a
state `load` asks DCP for the saved keys instead: each as a staging ShardedTensor `[rows]`
holding the rows this rank's shards of the state cover (the other rows are placed on another
rank, so this rank never reads them). After every rank's verdict is in, `finish` writes each
live shard from the staged values (`combine_rows`: exact width-weighted mean from column
shards, the covering block's value towards them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from recshard.checkpoint.staging import describe_key
from recshard.distributed.sharded_state import quiet_sharded_tensor
from recshard.optim.column_state import Block, by_state, column_blocks, fill_rows, state_key

Rows = Tuple[int, int]  # (first row, rows)


def _merged_rows(targets: List[ShardedTensor]) -> List[Rows]:
    """The row ranges this rank's shards of `targets` cover, merged and sorted."""
    spans = sorted(
        (s.metadata.shard_offsets[0], s.metadata.shard_sizes[0])
        for t in targets
        for s in t.local_shards()
    )
    merged: List[Rows] = []
    for start, rows in spans:
        if merged and start <= merged[-1][0] + merged[-1][1]:
            first, count = merged[-1]
            merged[-1] = (first, max(count, start + rows - first))
        else:
            merged.append((start, rows))
    return merged


def _staging(rows: int, mine: List[Rows], like: ShardedTensor) -> ShardedTensor:
    """A `[rows]` float32 ShardedTensor whose local shards are zeroed buffers for `mine`; the
    rows between them are placed on another rank (metadata only: nothing is read for them)."""
    placement = like.local_shards()[0].metadata.placement
    pg = like._process_group
    here = placement.rank()
    elsewhere = f"rank:{(here + 1) % dist.get_world_size(pg)}/{placement.device()}"
    metas, local, at = [], [], 0
    for start, count in mine + [(rows, 0)]:
        if start > at:
            metas.append(ShardMetadata([at], [start - at], elsewhere))
        if count:
            meta = ShardMetadata([start], [count], placement)
            metas.append(meta)
            buffer = torch.zeros(count, dtype=torch.float32, device=placement.device())
            local.append(Shard(buffer, meta))
        at = start + count
    global_meta = ShardedTensorMetadata(
        metas, torch.Size([rows]), TensorProperties(dtype=torch.float32)
    )
    with quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, global_meta, process_group=pg
        )


def _rows_of(staged: ShardedTensor, start: int, count: int) -> torch.Tensor:
    for shard in staged.local_shards():
        first, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        if first <= start and start + count <= first + rows:
            return shard.tensor.narrow(0, start - first, count)
    raise AssertionError(f"rows {start}..{start + count} were not staged")  # see _merged_rows


@dataclass
class Relayout:
    """One row-wise state of one table: its live shards and column blocks, and the saved
    blocks staged for this rank."""

    targets: Dict[int | None, ShardedTensor]
    target_blocks: Dict[int | None, Block]
    staged: Dict[int | None, ShardedTensor]
    saved_blocks: Dict[int | None, Block]

    def finish(self) -> None:
        """Write every live shard from the staged blocks (after all ranks agreed to load)."""
        saved = [(self.saved_blocks[o], partial(_rows_of, s)) for o, s in self.staged.items()]
        for offset, target in self.targets.items():
            fill_rows(target, self.target_blocks[offset], saved)


def plan_relayouts(
    template: Dict[str, Dict[str, Any]], saved: Metadata, section: str, directory: Any
) -> List[Relayout]:
    """For every row-wise state in `template[section]` saved under other keys (another column
    layout), swap its live entries for staging ones under the saved keys; `Relayout.finish`
    then fills the live state. The table's width comes from its weight in `template["model"]`."""
    entries = template[section]
    stored = by_state(
        {
            key[len(section) + 1 :]: meta
            for key, meta in saved.state_dict_metadata.items()
            if key.startswith(section + ".") and isinstance(meta, TensorStorageMetadata)
        }
    )
    plans: List[Relayout] = []
    for family, targets in by_state(entries).items():
        found = stored.get(family, {})
        weight = template["model"].get(family.rpartition(".")[0])
        if not found or set(found) == set(targets) or weight is None or len(weight.size()) != 2:
            continue  # same layout (or nothing to convert from): DCP reads it as it is
        if any(len(t.size()) != 1 for t in targets.values()) or any(
            len(m.size) != 1 for m in found.values()
        ):
            continue  # per-element state keeps its key in every layout
        what = f"checkpoint {directory}: {describe_key(family)} ({section})"
        dim = weight.size()[1]
        plan = Relayout(
            dict(targets), column_blocks(targets, dim, what), {}, column_blocks(found, dim, what)
        )
        for offset in targets:
            del entries[state_key(family, offset)]
        mine = _merged_rows(list(targets.values()))
        if mine:  # a rank holding none of this table's shards reads nothing of it
            like = next(t for t in targets.values() if t.local_shards())
            rows = like.size()[0]
            for offset in found:
                plan.staged[offset] = _staging(rows, mine, like)
                entries[state_key(family, offset)] = plan.staged[offset]
        plans.append(plan)
    return plans
