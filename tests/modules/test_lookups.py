"""The unsharded collections' lookups against torch's own modules (`nn.EmbeddingBag`,
`nn.Embedding`): identical outputs, the same gradients for the table and the per-id weights,
and the same errors for ids outside the table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recshard.modules.lookups import bag_of_each_id, pooled_lookup, sequence_lookup


def _bags(seed: int, rows: int, batch: int, dtype: torch.dtype = torch.int64):
    """ids with repeats, empty bags at the start, middle and end, bag starts `[B]`."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (batch,), generator=g)
    lengths[0] = lengths[batch // 2] = lengths[-1] = 0
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g).to(dtype)
    starts = torch.cumsum(lengths, 0) - lengths
    return ids, starts.to(dtype), lengths


def test_bag_of_each_id_skips_empty_bags() -> None:
    starts = torch.tensor([0, 0, 2, 2, 3])
    assert bag_of_each_id(starts, 5).tolist() == [1, 1, 3, 4, 4]
    assert bag_of_each_id(torch.tensor([], dtype=torch.long), 0).tolist() == []


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_matches_nn_embedding_bag(dtype: torch.dtype, weighted: bool) -> None:
    torch.manual_seed(0)
    ids, starts, _ = _bags(1, rows=7, batch=40, dtype=dtype)  # few rows: many repeated ids
    reference = nn.EmbeddingBag(7, 5, mode="sum")
    weight = nn.Parameter(reference.weight.detach().clone())
    per_id: torch.Tensor | None = torch.rand(ids.numel()) if weighted else None
    ref_per_id = None if per_id is None else per_id.clone().requires_grad_()
    ours_per_id = None if per_id is None else per_id.clone().requires_grad_()
    expected = reference(ids, starts, per_sample_weights=ref_per_id)
    got = pooled_lookup(weight, ids, starts, ours_per_id)
    assert torch.equal(got, expected)  # forward is torch's kernel
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(weight.grad, reference.weight.grad)
    if weighted:
        torch.testing.assert_close(ours_per_id.grad, ref_per_id.grad)


def test_pooled_lookup_gradcheck() -> None:
    ids, starts, _ = _bags(2, rows=4, batch=6)
    weight = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    per_id = torch.rand(ids.numel(), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, p: pooled_lookup(w, ids, starts, p), (weight, per_id))


def test_sequence_lookup_matches_nn_embedding() -> None:
    torch.manual_seed(0)
    reference = nn.Embedding(6, 4)
    weight = nn.Parameter(reference.weight.detach().clone())
    ids = torch.tensor([5, 0, 5, 5, 2, 0])
    expected, got = reference(ids), sequence_lookup(weight, ids)
    assert torch.equal(got, expected)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(weight.grad, reference.weight.grad)
    frozen = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: sequence_lookup(w, ids), (frozen,))


@pytest.mark.parametrize("bad", [7, -1])
def test_ids_outside_the_table_are_refused_by_the_kernel(bad: int) -> None:
    weight = torch.randn(7, 2, requires_grad=True)
    ids = torch.tensor([1, bad, 2])
    with pytest.raises((RuntimeError, IndexError)):
        pooled_lookup(weight, ids, torch.tensor([0, 1]))
    with pytest.raises((RuntimeError, IndexError)):
        sequence_lookup(weight, ids)
