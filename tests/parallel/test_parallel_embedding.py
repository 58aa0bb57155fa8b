"""ParallelEmbedding (embedding dim split) and VocabParallelEmbedding (rows split) against
nn.Embedding with the same seed: forward values, weight gradients (dense and sparse), and
nn.Embedding's options (padding_idx, max_norm, scale_grad_by_freq, sparse)."""

from __future__ import annotations

import sys
from typing import Any, Dict, List

import pytest
import torch
from parallel_helpers import assert_close, checks_of, expect_error, seeded, shard
from torch import nn

from recshard.parallel import ParallelEmbedding, VocabParallelEmbedding

NUM, DIM = 12, 8  # divisible by 1, 2 and 4
IDS = torch.tensor(
    [[0, 3, 3, 11, 5, 2], [7, 3, 0, 0, 10, 2], [1, 1, 1, 6, 9, 4], [8, 2, 3, 5, 5, 11]]
)

OPTIONS: List[Dict[str, Any]] = [
    {},
    {"padding_idx": 3},
    {"padding_idx": -1},
    {"scale_grad_by_freq": True},
    {"sparse": True, "padding_idx": 2},
    {"max_norm": 1.5},
    {"max_norm": 2.0, "norm_type": 1.0, "scale_grad_by_freq": True},
]


def _compare(rank: int, world_size: int, cls: type, shard_dim: int, extra: Dict[str, Any]) -> None:
    for options in OPTIONS:
        case = f"{cls.__name__} {options} {extra}"
        torch.manual_seed(21)
        ref = nn.Embedding(NUM, DIM, **options)
        torch.manual_seed(21)
        layer = cls(NUM, DIM, **options, **extra)
        assert_close(
            layer.weight, shard(ref.weight.detach(), shard_dim, rank, world_size), f"{case} init"
        )

        expected = ref(IDS)
        upstream = seeded(22, *expected.shape)
        (expected * upstream).sum().backward()
        out = layer(IDS)
        local_out_dim = extra.get("sequence_dim")
        if extra.get("gather_output") is False:
            local_out_dim = -1
        my_upstream = (
            upstream if local_out_dim is None else shard(upstream, local_out_dim, rank, world_size)
        )
        (out * my_upstream).sum().backward()
        master = layer.master_weight

        want = (
            expected.detach()
            if local_out_dim is None
            else shard(expected.detach(), local_out_dim, rank, world_size)
        )
        assert_close(out, want, f"{case} forward")
        assert layer.weight.grad.is_sparse == options.get("sparse", False), f"{case} grad layout"
        want_grad = shard(ref.weight.grad.to_dense(), shard_dim, rank, world_size)
        assert_close(layer.weight.grad, want_grad, f"{case} weight grad")
        assert_close(
            master, ref.weight.detach(), f"{case} master weight (after any max_norm renorm)"
        )


def check_parallel_embedding(rank: int, world_size: int) -> None:
    _compare(rank, world_size, ParallelEmbedding, 1, {})
    _compare(rank, world_size, ParallelEmbedding, 1, {"gather_output": False})


def check_vocab_parallel_embedding(rank: int, world_size: int) -> None:
    _compare(rank, world_size, VocabParallelEmbedding, 0, {})


def check_vocab_parallel_embedding_sequence_output(rank: int, world_size: int) -> None:
    """Output reduce-scattered over the sequence dim (ids [B, S], S divisible by ws)."""
    ids = torch.arange(2 * 4 * world_size).reshape(2, 4 * world_size) % NUM
    torch.manual_seed(23)
    ref = nn.Embedding(NUM, DIM)
    torch.manual_seed(23)
    layer = VocabParallelEmbedding(NUM, DIM, sequence_dim=1)
    expected = ref(ids)
    upstream = seeded(24, *expected.shape)
    (expected * upstream).sum().backward()
    out = layer(ids)
    (out * shard(upstream, 1, rank, world_size)).sum().backward()
    assert_close(out, shard(expected.detach(), 1, rank, world_size), "sequence-sharded output")
    assert_close(layer.weight.grad, shard(ref.weight.grad, 0, rank, world_size), "weight grad")


def check_embedding_from_existing(rank: int, world_size: int) -> None:
    torch.manual_seed(25)
    ref = nn.Embedding(NUM, DIM, padding_idx=5, max_norm=3.0)
    for cls in (ParallelEmbedding, VocabParallelEmbedding):
        layer = cls.from_embedding(ref)
        assert (layer.padding_idx, layer.max_norm) == (5, 3.0)
        assert_close(layer(IDS), ref(IDS).detach(), f"{cls.__name__}.from_embedding forward")


def check_init_method(rank: int, world_size: int) -> None:
    init = lambda w: nn.init.uniform_(w, -0.1, 0.1)  # noqa: E731
    for cls, dim in ((ParallelEmbedding, 1), (VocabParallelEmbedding, 0)):
        torch.manual_seed(26)
        full = torch.empty(NUM, DIM)
        init(full)
        full[4] = 0
        torch.manual_seed(26)
        layer = cls(NUM, DIM, padding_idx=4, init_method=init)
        assert_close(
            layer.weight, shard(full, dim, rank, world_size), f"{cls.__name__} init_method"
        )


def check_embedding_errors(rank: int, world_size: int) -> None:
    n = world_size + 1
    if world_size > 1:
        expect_error(
            lambda: ParallelEmbedding(10, n),
            rf"^ParallelEmbedding: embedding_dim={n} is not divisible by the model-parallel "
            rf"group size {world_size}$",
        )
        expect_error(
            lambda: VocabParallelEmbedding(n, 8),
            rf"^VocabParallelEmbedding: num_embeddings={n} is not divisible by the "
            rf"model-parallel group size {world_size}$",
        )
    for cls in (ParallelEmbedding, VocabParallelEmbedding):
        name = cls.__name__
        layer = cls(NUM, DIM)
        expect_error(
            lambda layer=layer: layer(torch.tensor([1, NUM])),
            rf"^{name}: id {NUM} is out of range \[0, {NUM}\)$",
        )
        expect_error(
            lambda layer=layer: layer(torch.tensor([[-3, 1]])), rf"{name}: id -3 is out of range"
        )
        expect_error(
            lambda layer=layer: layer(torch.tensor([1.0])),
            rf"{name} expects int32/int64 ids, got dtype torch.float32",
        )
        expect_error(
            lambda cls=cls: cls(NUM, DIM, padding_idx=NUM),
            rf"padding_idx={NUM} must be within num_embeddings={NUM}",
        )
        expect_error(
            lambda cls=cls: cls(NUM, DIM, _weight=torch.zeros(3, 3)),
            r"_weight has shape \(3, 3\), expected \(12, 8\)",
        )


@pytest.mark.parametrize("name", [f.__name__ for f in checks_of(sys.modules[__name__])])
def test_parallel_embedding_check_holds_on_every_rank(rank_results, name: str) -> None:
    """Each `check_*` above, run on every rank of a real gloo group, holds there."""
    rank_results.verify(name)
