"""Every jagged op refuses lengths/offsets that reach outside its values, on both backends.

fbgemm's CPU ops read and write past the end on such input (garbage values, a corrupted
heap); the torch path clamps or raises IndexError. Both must raise the same clear error.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from ops_reference import BACKENDS

from recshard.sparse import jagged_ops as ops

t = torch.tensor

CASES: dict[str, tuple[Callable[[], object], str]] = {
    "permute_1D lengths past values": (
        lambda: ops.permute_1D_sparse_data(t([1, 0]), t([5, 5]), torch.arange(4)),
        "lengths reach 10 values, past the 4 given",
    ),
    "permute_1D negative length": (
        lambda: ops.permute_1D_sparse_data(t([1, 0]), t([-3, 5]), torch.arange(4)),
        "negative length -3",
    ),
    "permute_1D weights of another size": (
        lambda: ops.permute_1D_sparse_data(t([1, 0]), t([2, 2]), torch.arange(4), torch.ones(3)),
        "weights has 3 entries, not one per value",
    ),
    "permute_2D lengths past values": (
        lambda: ops.permute_2D_sparse_data(t([1, 0]), t([[5, 5], [5, 5]]), torch.arange(4)),
        "lengths reach 20 values",
    ),
    "padded offsets past values": (
        lambda: ops.jagged_to_padded_dense(torch.arange(4.0), t([0, 3, 9]), 6),
        "offsets reach 9 values",
    ),
    "padded offsets decreasing": (
        lambda: ops.jagged_to_padded_dense(torch.arange(4.0), t([0, 3, 1]), 6),
        r"non-decreasing from >= 0, got \[0, 3, 1\]",
    ),
    "padded offsets negative": (
        lambda: ops.jagged_to_padded_dense(torch.arange(4.0), t([-3, 1, 2]), 6),
        "non-decreasing",
    ),
    "pooled offsets past columns": (
        lambda: ops.permute_pooled_embs(
            torch.ones(2, 4), t([0, 2, 9]), t([1, 0]), t([0, 7, 9]), t([1, 0])
        ),
        "offset_dim_list reach 9 values, past the 4",
    ),
    "expand output offsets decreasing": (
        lambda: ops.expand_into_jagged_permute(t([1, 0]), t([0, 2, 4]), t([0, 3, 1]), 1),
        "output_offsets must be non-decreasing",
    ),
    "segment sum past values": (
        lambda: ops.segment_sum_csr(2, t([0, 2, 7]), torch.ones(12)),
        "reach 14 values, past the 12",
    ),
    "segment sum decreasing": (
        lambda: ops.segment_sum_csr(1, t([0, 3, 2]), torch.ones(12)),
        "non-decreasing",
    ),
    "segment sum negative batch": (
        lambda: ops.segment_sum_csr(-1, t([0, 1]), torch.ones(12)),
        "batch_size must be >= 0",
    ),
    "bucketize lengths past ids": (
        lambda: ops.block_bucketize_sparse_features(
            t([5, 5]), torch.arange(4), False, False, t([2, 2]), 2
        ),
        "lengths reach 10 values, past the 4 given",
    ),
    "bucketize weights of another size": (
        lambda: ops.block_bucketize_sparse_features(
            t([2, 2]), torch.arange(4), False, False, t([2, 2]), 2, torch.ones(3)
        ),
        "weights has 3 entries",
    ),
}


@pytest.mark.parametrize("fbgemm", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_jagged_ops_refuse_bounds_outside_values(fbgemm: bool, case: str) -> None:
    call, match = CASES[case]
    with ops.use_fbgemm(fbgemm), pytest.raises(ValueError, match=match):
        call()
