"""Row-wise state between column layouts, on values: the covering block's value, else the
overlap-weighted mean; keys and blocks parsed and checked."""

from __future__ import annotations

import pytest
import torch

from recshard.optim.column_state import by_state, column_blocks, combine_rows, split_key


def test_keys_and_blocks() -> None:
    assert split_key("momentum1@col12") == ("momentum1", 12)
    assert split_key("momentum1") == ("momentum1", None)
    assert by_state({"m@col0": 1, "m@col3": 2, "v": 3}) == {"m": {0: 1, 3: 2}, "v": {None: 3}}
    assert column_blocks([3, 0], 8, "t") == {3: (3, 5), 0: (0, 3)}
    assert column_blocks([None], 8, "t") == {None: (0, 8)}
    with pytest.raises(ValueError, match=r"table 't5'.*offsets \[2, 4\].*width 8"):
        column_blocks([2, 4], 8, "table 't5'")
    with pytest.raises(ValueError, match=r"offsets \[0, 8\]"):
        column_blocks([0, 8], 8, "t")


def test_combine_rows() -> None:
    a, b, c = torch.tensor([1.0, 4.0]), torch.tensor([2.0, 8.0]), torch.tensor([7.0, 1.0])
    saved = [((0, 2), a), ((2, 1), b), ((3, 3), c)]
    assert torch.equal(combine_rows(saved, (0, 6)), (2 * a + b + 3 * c) / 6)  # whole row
    assert torch.equal(combine_rows(saved, (1, 3)), (a + b + c) / 3)  # straddles three
    assert torch.equal(combine_rows(saved, (4, 1)), c)  # inside one: its value, exactly
    whole = torch.tensor([0.1, 0.7])
    assert torch.equal(combine_rows([((0, 6), whole)], (3, 3)), whole)
