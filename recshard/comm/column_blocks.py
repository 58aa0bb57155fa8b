"""Lay column blocks of row-major chunks side by side, in any order, with one copy each way.

A pooled all-to-all receives one `[B, D_r]` chunk per rank, one after another in a flat
buffer; the sharded module wants the columns in its own key order. `chunks_to_columns`
goes from the flat buffer straight to that order: each output block is copied once from its
chunk, and backward copies each block of the gradient once back into a flat buffer shaped
like the input. Both buffers are reused across steps (`recshard.comm.buffers`). (A `cat` of the
chunks followed by a block permute copies twice each way, and the split that cuts the flat buffer
into chunks adds a third copy in backward.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from recshard.comm import buffers

Block = Tuple[int, int, int]  # (chunk, first column within the chunk, width)


def whole_chunks(chunk_widths: Sequence[int]) -> List[Block]:
    """The identity layout: every chunk whole, in chunk order."""
    return [(c, 0, width) for c, width in enumerate(chunk_widths) if width]


def cut_at_chunks(spans: Sequence[Tuple[int, int]], chunk_widths: Sequence[int]) -> List[Block]:
    """`(start, width)` spans over the chunks' columns laid side by side, in output order ->
    blocks within single chunks (a span crossing a chunk edge is cut in two)."""
    edges = list(itertools.accumulate(chunk_widths, initial=0))
    blocks: List[Block] = []
    for start, width in spans:
        end = start + width
        while start < end:
            chunk = next(c for c in range(len(chunk_widths)) if edges[c] <= start < edges[c + 1])
            stop = min(end, edges[chunk + 1])
            blocks.append((chunk, start - edges[chunk], stop - start))
            start = stop
    return blocks


def check_blocks(blocks: Sequence[Block], chunk_widths: Sequence[int]) -> List[Block]:
    """`blocks` if they cover every column of every chunk exactly once, else ValueError."""
    covered = {c: 0 for c in range(len(chunk_widths))}
    for c, start, width in sorted(blocks):
        if c not in covered or start != covered[c] or width <= 0:
            break
        covered[c] = start + width
    else:
        if all(covered[c] == w for c, w in enumerate(chunk_widths)):
            return list(blocks)
    raise ValueError(
        f"column blocks {list(blocks)} do not cover chunk widths {list(chunk_widths)} exactly once"
    )


@dataclass(frozen=True)
class _Run:
    """Blocks copied by one strided copy: `count` blocks of `width` columns, back to back in
    `chunk` from `chunk_start`, landing `out_stride` apart in the output from `out_start`."""

    chunk: int
    chunk_start: int
    width: int
    count: int
    out_start: int
    out_stride: int


def strided_runs(blocks: Sequence[Block]) -> List[_Run]:
    """`blocks` (in output order) merged into strided runs: column-wise tables interleave
    every rank's equal-width shards, 2 copies instead of one per shard and rank."""
    runs: List[_Run] = []
    open_run: Dict[int, int] = {}  # chunk -> index in runs of its last run
    out = 0
    for chunk, start, width in blocks:
        i = open_run.get(chunk)
        run = runs[i] if i is not None else None
        if (
            run is not None
            and run.width == width
            and run.chunk_start + run.count * width == start
            and (run.count == 1 or run.out_start + run.count * run.out_stride == out)
        ):
            stride = out - run.out_start if run.count == 1 else run.out_stride
            runs[i] = _Run(chunk, run.chunk_start, width, run.count + 1, run.out_start, stride)
        else:
            open_run[chunk] = len(runs)
            runs.append(_Run(chunk, start, width, 1, out, width))
        out += width
    return runs


def runs_by_chunk(blocks: Sequence[Block]) -> Dict[int, List[_Run]]:
    """`strided_runs(blocks)` grouped by the chunk each run reads: what one chunk's copies are."""
    grouped: Dict[int, List[_Run]] = {}
    for run in strided_runs(blocks):
        grouped.setdefault(run.chunk, []).append(run)
    return grouped


def _run_views(
    columns: torch.Tensor, chunk: torch.Tensor, run: _Run
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the output's columns, the chunk's columns) of `run`, as `[rows, count, width]` views."""
    rows = columns.size(0)
    out = columns.as_strided(
        (rows, run.count, run.width),
        (columns.stride(0), run.out_stride * columns.stride(1), columns.stride(1)),
        columns.storage_offset() + run.out_start * columns.stride(1),
    )
    src = chunk[:, run.chunk_start : run.chunk_start + run.count * run.width]
    return out, src.unflatten(1, (run.count, run.width))


def lay_chunk(columns: torch.Tensor, chunk: torch.Tensor, runs: Sequence[_Run]) -> None:
    """Copy `chunk` (`[rows, w]`, one chunk's values) into its blocks of `columns`; `runs`: that
    chunk's runs (`runs_by_chunk`). A copy that casts where the dtypes differ."""
    for run in runs:
        dst, src = _run_views(columns, chunk, run)
        dst.copy_(src)


def pack_chunk(
    columns: torch.Tensor, chunk: torch.Tensor, runs: Sequence[_Run], divisor: int = 1
) -> None:
    """The transpose of `lay_chunk`: `chunk` (`[rows, w]`, contiguous) gets its blocks of
    `columns` (any strides), divided by `divisor` after the copies (a contiguous pass)."""
    for run in runs:
        src, dst = _run_views(columns, chunk, run)
        dst.copy_(src)
    if divisor != 1:
        chunk.div_(divisor)


def chunk_views(flat: torch.Tensor, rows: int, chunk_widths: Sequence[int]) -> List[torch.Tensor]:
    """`flat` cut into its `[rows, w]` row-major chunks (`w` in `chunk_widths`)."""
    offsets = itertools.accumulate((rows * w for w in chunk_widths), initial=0)
    return [flat[start : start + rows * w].view(rows, w) for start, w in zip(offsets, chunk_widths)]


def columns_from_chunks(
    flat: torch.Tensor,
    rows: int,
    chunk_widths: Sequence[int],
    blocks: Sequence[Block],
    dtype: torch.dtype,
) -> torch.Tensor:
    """`[rows, sum(chunk_widths)]` of `dtype` from the chunks in `flat`, one copy per block
    (a copy that also casts when `flat` is of another dtype: a cast codec's decode for free)."""
    chunks = chunk_views(flat, rows, chunk_widths)
    width = sum(chunk_widths)
    out = buffers.take("columns", rows * width, dtype, flat.device).view(rows, width)
    for chunk, runs in runs_by_chunk(blocks).items():
        lay_chunk(out, chunks[chunk], runs)
    return out


def chunks_from_columns(
    columns: torch.Tensor,
    chunk_widths: Sequence[int],
    blocks: Sequence[Block],
    dtype: torch.dtype,
    divisor: int = 1,
) -> torch.Tensor:
    """The transpose of `columns_from_chunks`: a flat buffer of `dtype` holding the chunks (a
    cast codec's encode happens in the same copy), divided by `divisor` as it copies;
    `columns` may have any strides."""
    flat = buffers.take("columns_bwd", columns.size(0) * sum(chunk_widths), dtype, columns.device)
    chunks = chunk_views(flat, columns.size(0), chunk_widths)
    for chunk, runs in runs_by_chunk(blocks).items():
        pack_chunk(columns, chunks[chunk], runs)
    if divisor != 1:
        flat.div_(divisor)
    return flat


class _ChunksToColumns(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        flat: torch.Tensor,
        rows: int,
        chunk_widths: Sequence[int],  # noqa: ANN001
        blocks: Sequence[Block],
    ) -> torch.Tensor:
        ctx.chunk_widths, ctx.blocks = chunk_widths, blocks
        return columns_from_chunks(flat, rows, chunk_widths, blocks, flat.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return chunks_from_columns(grad, ctx.chunk_widths, ctx.blocks, grad.dtype), None, None, None


def chunks_to_columns(
    flat: torch.Tensor, rows: int, chunk_widths: Sequence[int], blocks: Sequence[Block]
) -> torch.Tensor:
    """`flat` holds `[rows, w]` row-major chunks one after another (`w` in `chunk_widths`);
    returns `[rows, sum(chunk_widths)]`: the `blocks` side by side in the given order. The
    blocks must cover every chunk column once (`check_blocks`, done where they are made)."""
    if flat.numel() != rows * sum(chunk_widths):
        raise ValueError(
            f"chunks_to_columns: {flat.numel()} values, but {rows} rows of chunk "
            f"widths {list(chunk_widths)} need {rows * sum(chunk_widths)}"
        )
    return _ChunksToColumns.apply(flat, rows, list(chunk_widths), list(blocks))
