"""Fuzzing VBE: the sharded EBC equals the unsharded one on hypothesis-drawn variable batches
at world size 2 (slow). Each case draws a plan kind (every sharding type and mixed, one or
two "nodes"), fused or dense kernels, the fused optimizer, weighted or not, shared features,
and for 2 steps x 2 ranks the output rows (1-4) and each feature's batch size (1-4); lengths
(0-3 ids, so empty bags and empty features) and inverse indices come from a seeded generator.
Checked as `test_sharded_variable_batch.py` does: forward, tables and fused state per step.

Cases are drawn in the parent with a fixed seed (derandomized, no database, no shrinking) and
run in one group of two ranks, so both see the same cases in the same order.
"""

from __future__ import annotations

import functools
from typing import List

import pytest
from drawn_cases import draw_distinct
from hypothesis import strategies as st
from multiprocess import run_ranks
from test_sharded_variable_batch import KINDS, VbeCase, check, run_all
from vbe_cases import KEYS

WS = 2
sizes = st.tuples(st.integers(1, 4), st.tuples(*[st.integers(1, 4) for _ in KEYS]))


@st.composite
def cases(draw: st.DrawFn) -> VbeCase:
    kernel = draw(st.sampled_from(["fused", "dense"]))
    return VbeCase(
        local_world_size=draw(st.sampled_from([WS, 1])),
        kind=draw(st.sampled_from(KINDS)),
        kernel=kernel,
        optimizer="sgd" if kernel == "dense" else draw(st.sampled_from(["sgd", "rowwise_adagrad"])),
        weighted=draw(st.booleans()),
        shape="drawn",
        shared=draw(st.booleans()),
        drawn=tuple(tuple(draw(sizes) for _ in range(WS)) for _ in range(2)),
    )


@functools.cache
def draw_cases(count: int) -> List[VbeCase]:
    return draw_distinct(cases(), count)


@pytest.mark.slow
def test_sharded_ebc_matches_unsharded_on_drawn_variable_batches() -> None:
    check(run_ranks(WS, run_all, draw_cases(60), timeout=1500))
