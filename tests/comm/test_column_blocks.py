"""`chunks_to_columns`: blocks of row-major chunks laid side by side, forward and backward,
against `torch.cat` + column indexing on the same values."""

from __future__ import annotations

from typing import List

import pytest
import torch

from recshard.comm.column_blocks import (
    Block,
    check_blocks,
    chunks_from_columns,
    chunks_to_columns,
    cut_at_chunks,
    strided_runs,
    whole_chunks,
)


def reference(
    flat: torch.Tensor, rows: int, widths: List[int], blocks: List[Block]
) -> torch.Tensor:
    chunks = list(flat.split([rows * w for w in widths]))
    return torch.cat([chunks[c].view(rows, widths[c])[:, s : s + w] for c, s, w in blocks], dim=1)


@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "blocks",
    [
        [(0, 0, 3), (1, 0, 2), (2, 0, 4)],  # whole chunks, chunk order
        [(2, 2, 2), (0, 1, 2), (1, 0, 2), (2, 0, 2), (0, 0, 1)],  # shuffled pieces
        [(0, 0, 1), (2, 0, 1), (0, 1, 1), (2, 1, 1), (0, 2, 1), (2, 2, 1), (1, 0, 2), (2, 3, 1)],
    ],
)
def test_forward_and_backward_match_cat_and_slices(
    rows: int, dtype: torch.dtype, blocks: List[Block]
) -> None:
    widths = [3, 2, 4]
    check_blocks(blocks, widths)
    g = torch.Generator().manual_seed(rows)
    flat = torch.randn(rows * sum(widths), generator=g).to(dtype).requires_grad_()
    flat_ref = flat.detach().clone().requires_grad_()
    out, want = (
        chunks_to_columns(flat, rows, widths, blocks),
        reference(flat_ref, rows, widths, blocks),
    )
    assert torch.equal(out, want)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad)
    want.backward(grad)
    assert torch.equal(flat.grad, flat_ref.grad)


def test_cut_at_chunks_splits_spans_at_chunk_edges() -> None:
    # chunks of widths 3 and 2 side by side: columns 0-2 | 3-4
    assert cut_at_chunks([(2, 2), (0, 2), (4, 1)], [3, 2]) == [
        (0, 2, 1),
        (1, 0, 1),
        (0, 0, 2),
        (1, 1, 1),
    ]
    assert cut_at_chunks([(0, 5)], [3, 0, 2]) == [(0, 0, 3), (2, 0, 2)]
    assert whole_chunks([3, 0, 2]) == [(0, 0, 3), (2, 0, 2)]


@pytest.mark.parametrize(
    "blocks",
    [
        [(0, 0, 3)],  # chunk 1 missing
        [(0, 0, 3), (1, 0, 1), (1, 0, 1)],  # a column twice
        [(0, 0, 3), (1, 1, 1), (1, 0, 1), (2, 0, 1)],  # no chunk 2
        [(0, 0, 4), (1, 0, 2)],  # past the chunk
    ],
)
def test_blocks_that_do_not_cover_each_column_once_are_rejected(blocks: List[Block]) -> None:
    with pytest.raises(ValueError, match="exactly once"):
        check_blocks(blocks, [3, 2])


def test_wrong_buffer_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="need 10"):
        chunks_to_columns(torch.zeros(9), 2, [3, 2], whole_chunks([3, 2]))


def test_interleaved_shards_copy_as_one_strided_run_per_chunk() -> None:
    """Column-wise layout: table t's columns are rank 0's shard then rank 1's."""
    blocks = [(r, 2 * t, 2) for t in range(3) for r in range(2)]
    runs = strided_runs(blocks)
    assert [(r.chunk, r.count, r.out_start, r.out_stride) for r in runs] == [
        (0, 3, 0, 4),
        (1, 3, 2, 4),
    ]
    rows, widths = 5, [6, 6]
    flat = torch.randn(rows * 12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(
        chunks_to_columns(flat, rows, widths, blocks), reference(flat, rows, widths, blocks)
    )


def test_packing_an_expanded_gradient_divides_like_a_division_after() -> None:
    """The backward pack reads a stride-0 gradient (of a sum) and divides in the same pass."""
    blocks = [(r, 2 * t, 2) for t in range(3) for r in range(2)]
    rows, widths = 4, [6, 6]
    grad = torch.full((1,), 0.3).expand(rows, 12)
    packed = chunks_from_columns(grad, widths, blocks, torch.float32, divisor=3).clone()
    want = chunks_from_columns(grad.contiguous(), widths, blocks, torch.float32).clone()
    assert torch.equal(packed, want.div_(3))
