"""Bad use of the sharded FeatureProcessedEmbeddingBagCollection: a bag longer than its
feature's max_feature_length on one rank stops every rank with a clear error (then a good step
goes through); a processor that needs whole bags on a row-wise table is refused when sharding."""

from __future__ import annotations

from typing import List

import pytest
import torch
from ebc_cases import batch
from fp_cases import make_fp_ebc, sharded_model
from multiprocess import run_ranks

from recshard import KeyedJaggedTensor
from recshard.distributed.sharding_plan import row_wise


def _too_long() -> KeyedJaggedTensor:
    """f0 has a bag of 4 ids (its max_feature_length is 3)."""
    keys = ["f0", "f1", "f2", "f3", "f4", "f5"]
    lengths = torch.tensor([4, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0])
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.zeros(9, dtype=torch.int64), lengths)


def one_rank_too_long(rank: int, ws: int, kind: str) -> List[str]:
    model = sharded_model(make_fp_ebc("collection"), kind, "fused", ws)
    messages = []
    try:
        model(_too_long() if rank == 1 else batch(rank, 0, 2, False, False))
        messages.append("no error")
    except (ValueError, RuntimeError) as e:  # this rank's reason, or another rank's verdict
        messages.append(f"{type(e).__name__}: {e}")
    model(batch(rank, 1, 2, False, False)).values().sum().backward()  # the group still works
    return messages


@pytest.mark.parametrize("kind", ["row_wise", "data_parallel"])
def test_a_bag_longer_than_max_feature_length_stops_every_rank(kind: str) -> None:
    results = run_ranks(2, one_rank_too_long, kind, timeout=120)
    rank1, rank0 = results[1][0], results[0][0]
    assert rank1.startswith("ValueError: ") and "feature 'f0' has a bag of 4 ids" in rank1
    assert "max_feature_length 3" in rank1
    assert "rank 1 rejected its input" in rank0 and "'f0'" in rank0


def custom_processor_on_row_wise(rank: int, ws: int) -> str:
    reference = make_fp_ebc("custom")
    per_table = {t: row_wise() for t in ("t0", "t1", "t2", "t3", "t4")}
    try:
        sharded_model(reference, "", "fused", ws, per_table=per_table)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_whole_bag_processor_refuses_row_wise_tables() -> None:
    message = run_ranks(1, custom_processor_on_row_wise, timeout=60)[0]
    assert "row-wise" in message and "t0" in message, message


def test_unsharded_module_names_the_feature() -> None:
    with pytest.raises(ValueError, match="feature 'f0' has a bag of 4 ids"):
        make_fp_ebc("collection")(_too_long())
    with pytest.raises(ValueError, match="feature 'f0' has a bag of 4 ids"):
        make_fp_ebc("dict")(_too_long())
    with pytest.raises(ValueError, match="a bag of 4 ids is longer than max_feature_length 3"):
        make_fp_ebc("dict")._feature_processors["f0"](_too_long()["f0"])
