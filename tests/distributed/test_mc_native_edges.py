"""mc_index.cpp's draws and contest at their edges. `rs_mc_draw_uniform` (the default init's
re-draws of a managed-collision reset, several in one call): no rows, column shards at odd
offsets and of odd widths, one-column tables, rows in any order, strided row matrices, against
mc_reset's torch ops (the same counter-based numbers); bad arguments refused before any write.
`rs_mc_contest`: empty buckets, free rows, ties, infinite and NaN scores (NaN ranks as -inf),
against `rank_contest`."""

from __future__ import annotations

from typing import List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recshard.distributed import mc_library, mc_native, mc_native_draw
from recshard.distributed.mc_reset import draw_into, uniform_draw
from recshard.modules import EmbeddingBagConfig
from recshard.modules.mc_compete import rank_contest

pytestmark = pytest.mark.skipif(not mc_library.available(), reason="mc_index not built")


def _config(dim: int) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name="t", embedding_dim=dim, num_embeddings=8, feature_names=["f"],
        weight_init_min=-0.37, weight_init_max=0.91,
    )  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(
    dim=st.sampled_from([1, 2, 3, 7, 16, 33, 129]),
    data=st.data(),
    seed=st.integers(0, 2**62),
    row_count=st.integers(0, 40),
)
def test_native_draws_are_the_torch_ops_numbers(
    dim: int, data: st.DataObject, seed: int, row_count: int
) -> None:
    col_offset = data.draw(st.integers(0, dim - 1))
    cols = data.draw(st.integers(0, dim - col_offset))
    n = data.draw(st.integers(0, row_count))
    rows = torch.randperm(row_count, generator=torch.Generator().manual_seed(seed % 1000))[:n]
    config = _config(dim)
    pad = data.draw(st.integers(0, 3))
    native = torch.full((row_count, cols + pad), 7.0)[:, :cols]  # rows `cols + pad` apart
    mc_native_draw.draw_uniform([uniform_draw(seed, config, col_offset, native, rows)])
    by_torch = torch.full((cols, row_count), 7.0).t()  # stride(1) != 1: mc_reset's torch ops
    draw_into(uniform_draw(seed, config, col_offset, by_torch, rows))
    assert torch.equal(native.view(torch.int32), by_torch.contiguous().view(torch.int32))
    untouched = torch.ones(row_count, dtype=torch.bool)
    untouched[rows] = False
    assert bool((native[untouched] == 7.0).all())


def test_bad_arguments_are_refused_before_any_write() -> None:
    """A bad draw anywhere in a call refuses the whole call: the good draw before it is not
    written either."""
    out, good_out = torch.full((4, 3), 7.0), torch.full((4, 3), 7.0)
    good = mc_native_draw.UniformDraw(1, 3, 0, 0.0, 1.0, good_out, torch.tensor([0, 3]))
    for rows, dim, offset in (
        (torch.tensor([4]), 3, 0),  # a row past the matrix
        (torch.tensor([-1]), 3, 0),
        (torch.tensor([0]), 3, 1),  # columns past the table's dim
        (torch.tensor([0]), 0, 0),
    ):
        bad = mc_native_draw.UniformDraw(1, dim, offset, 0.0, 1.0, out, rows)
        with pytest.raises(RuntimeError, match="reset draw"):
            mc_native_draw.draw_uniform([good, bad])
        assert bool((out == 7.0).all()) and bool((good_out == 7.0).all())
    mc_native_draw.draw_uniform([good])
    assert bool((good_out[[0, 3]] != 7.0).all()) and bool((good_out[[1, 2]] == 7.0).all())


_FREE = torch.iinfo(torch.int64).max
_SCORES = [0.0, 1.0, 2.0, 3.0, float("inf"), -float("inf"), float("nan")]


@settings(max_examples=200, deadline=None)
@given(
    row_scores=st.lists(st.sampled_from(_SCORES)),
    new_scores=st.lists(st.sampled_from(_SCORES)),
    data=st.data(),
)
def test_native_contest_pairs_are_rank_contests(
    row_scores: List[float], new_scores: List[float], data: st.DataObject
) -> None:
    """The same (losing row, winning id) pairs as the torch ranking; empty sides give none."""
    slots = len(row_scores)
    ids = data.draw(st.lists(st.integers(0, 999), min_size=slots, max_size=slots, unique=True))
    free = data.draw(st.lists(st.booleans(), min_size=slots, max_size=slots))
    held = torch.tensor([_FREE if f else i for i, f in zip(ids, free)], dtype=torch.int64)
    rows = torch.tensor(row_scores, dtype=torch.float64)
    news = torch.tensor(new_scores, dtype=torch.float64)
    lose, win = mc_native.native_contest(rows, held, news)
    expected = rank_contest(rows, held, news)
    assert torch.equal(lose, expected[0]) and torch.equal(win, expected[1])
    if slots == 0 or not new_scores:
        assert lose.numel() == 0 and win.numel() == 0


def _nan_as_lowest(scores: List[float]) -> torch.Tensor:
    return torch.tensor([-float("inf") if s != s else s for s in scores], dtype=torch.float64)


@settings(max_examples=100, deadline=None)
@given(
    row_scores=st.lists(st.sampled_from(_SCORES), min_size=1, max_size=12),
    new_scores=st.lists(st.sampled_from(_SCORES), min_size=1, max_size=12),
)
def test_a_nan_score_ranks_as_minus_infinity(
    row_scores: List[float], new_scores: List[float]
) -> None:
    """Both contests give NaN scores the order of -inf: a NaN row loses first, a NaN new id
    wins nothing (std::sort on NaN would be undefined behaviour)."""
    held = torch.arange(len(row_scores), dtype=torch.int64)
    nan_rows = torch.tensor(row_scores, dtype=torch.float64)
    nan_news = torch.tensor(new_scores, dtype=torch.float64)
    expected = rank_contest(_nan_as_lowest(row_scores), held, _nan_as_lowest(new_scores))
    for ranking in (rank_contest, mc_native.native_contest):
        lose, win = ranking(nan_rows, held, nan_news)
        assert torch.equal(lose, expected[0]) and torch.equal(win, expected[1])


_EDGE_SCORES = [*_SCORES, -0.0, -1.0, 1e308, -1e308, 5e-324]


@pytest.mark.parametrize("seed", range(40))
def test_large_contests_with_signed_zeros_and_extremes_are_rank_contests(seed: int) -> None:
    """Hundreds of rows and new ids (nth_element and a sort over many, not a handful), scores
    among +-0, +-inf, NaN, +-1e308 and the least subnormal, every row free with one score (a
    first fill: no sort of the rows) in every fifth case."""
    gen = torch.Generator().manual_seed(seed)
    slots = int(torch.randint(1, 400, (1,), generator=gen))
    news = int(torch.randint(1, 600, (1,), generator=gen))
    pick = torch.tensor(_EDGE_SCORES, dtype=torch.float64)
    rows = pick[torch.randint(0, len(_EDGE_SCORES), (slots,), generator=gen)]
    new_scores = pick[torch.randint(0, len(_EDGE_SCORES), (news,), generator=gen)]
    held = torch.randperm(10 * slots, generator=gen)[:slots]
    held[torch.rand(slots, generator=gen) < 0.3] = _FREE
    if seed % 5 == 0:
        held[:] = _FREE
        rows[:] = rows[0]
    lose, win = mc_native.native_contest(rows, held, new_scores)
    expected = rank_contest(rows, held, new_scores)
    assert torch.equal(lose, expected[0]) and torch.equal(win, expected[1])


def test_draws_of_strided_rows_read_their_own_rows() -> None:
    """Rows given as strided views (each copied to a contiguous tensor for the C++ call): every
    draw reads its own rows, as drawn one at a time (the copies stay alive through the call)."""
    out = torch.zeros(40, 8)
    draws = [
        mc_native_draw.UniformDraw(seed, 8, 0, -0.5, 1.0, out, torch.arange(first, 40, 4)[::2])
        for seed, first in ((11, 0), (12, 1), (13, 2))
    ]
    mc_native_draw.draw_uniform(draws)
    expected = torch.zeros(40, 8)
    for draw in draws:
        one = torch.zeros(40, 8)
        mc_native_draw.draw_uniform(
            [mc_native_draw.UniformDraw(draw.seed, 8, 0, -0.5, 1.0, one, draw.rows.contiguous())]
        )
        expected[draw.rows] = one[draw.rows]
    assert torch.equal(out, expected)
