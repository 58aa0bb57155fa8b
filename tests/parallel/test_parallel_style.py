"""parallelize_module with ColwiseParallel / RowwiseParallel / SequenceParallel on a small
transformer-like block: outputs and gradients equal the unparallelized model, for plain
tensor parallelism and for sequence parallelism; wildcard FQNs; errors leave the model as is."""

from __future__ import annotations

import copy
import sys
from typing import Dict

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import assert_close, checks_of, expect_error, seeded, shard
from torch import nn
from torch.distributed.tensor import Replicate as TorchReplicate

from recshard.parallel import (
    ColumnParallelLinear,
    ColwiseParallel,
    ParallelDropout,
    ParallelEmbedding,
    Replicate,
    RowParallelLinear,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    VocabParallelEmbedding,
    parallelize_module,
)

VOCAB, DIM, HIDDEN, SEQ = 16, 8, 16, 8  # all divisible by 1, 2 and 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.drop = nn.Dropout(0.1)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(self.emb(ids)))
        h = h + self.w2(torch.relu(self.w1(h)))
        return self.head(h)


def _ids() -> torch.Tensor:
    return torch.arange(2 * SEQ).reshape(2, SEQ) * 5 % VOCAB


def _run(model: nn.Module, upstream: torch.Tensor) -> torch.Tensor:
    model.eval()  # dropout off: outputs comparable across layouts
    out = model(_ids())
    (out * upstream).sum().backward()
    return out.detach()


# parameter name -> (dim it is split along on this rank, or None when replicated)
_SPLITS: Dict[str, int | None] = {
    "emb.weight": 0,
    "norm.weight": None,
    "norm.bias": None,
    "w1.weight": 0,
    "w1.bias": 0,
    "w2.weight": 1,
    "w2.bias": None,
    "head.weight": 0,
    "head.bias": 0,
}


def _compare(
    rank: int, world_size: int, plan: dict, label: str, pg: dist.ProcessGroup | None = None
) -> nn.Module:
    rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
    torch.manual_seed(41)
    ref = _Block()
    model = parallelize_module(copy.deepcopy(ref), pg, plan)
    upstream = seeded(42, 2, SEQ, VOCAB)
    expected = _run(ref, upstream)
    out = _run(model, upstream)
    assert_close(out, expected, f"{label} forward")
    ref_grads = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        dim = _SPLITS[name]
        want = ref_grads[name].grad
        want = want if dim is None else shard(want, dim, rank, world_size)
        assert_close(param.grad, want, f"{label} grad of {name}")
    return model


def check_tensor_parallel_plan(rank: int, world_size: int) -> None:
    plan = {
        "emb": RowwiseParallel(),
        "w1": ColwiseParallel(),
        "w2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    model = _compare(rank, world_size, plan, "TP")
    if world_size == 4:  # two independent tensor-parallel groups of 2
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        sub = _compare(rank, world_size, plan, "TP subgroup", groups[rank // 2])
        assert sub.w1.world_size == 2 and sub.w1.pg is groups[rank // 2]
    assert isinstance(model.emb, VocabParallelEmbedding) and isinstance(
        model.w1, ColumnParallelLinear
    )
    assert isinstance(model.w2, RowParallelLinear) and model.w2.input_is_parallel
    assert type(model.norm) is nn.LayerNorm and type(model.drop) is nn.Dropout


def check_sequence_parallel_plan(rank: int, world_size: int) -> None:
    plan = {
        "emb": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "drop": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=TorchReplicate()),
    }
    model = _compare(rank, world_size, plan, "SP")
    assert model.w1.sequence_dim == 1 and model.w2.sequence_dim == 1 and model.emb.sequence_dim == 1
    assert isinstance(model.drop, ParallelDropout) and model.drop.input_is_parallel
    expect_error(
        lambda: parallelize_module(model, None, {"norm": SequenceParallel()}),
        "already sequence-parallel",
    )


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(torch.relu(self.w1(h)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return h


def check_wildcards_and_colwise_embedding(rank: int, world_size: int) -> None:
    torch.manual_seed(43)
    ref = _Stack()
    plan = {
        "emb": ColwiseParallel(output_layouts=Replicate()),
        "layers.*.w1": ColwiseParallel(),
        "layers.*.w2": RowwiseParallel(),
    }
    model = parallelize_module(copy.deepcopy(ref), None, plan)
    upstream = seeded(44, 2, SEQ, DIM)
    expected, out = _run(ref, upstream), _run(model, upstream)
    assert isinstance(model.emb, ParallelEmbedding) and model.emb.padding_idx == 0
    assert all(isinstance(layer.w1, ColumnParallelLinear) for layer in model.layers)
    assert_close(out, expected, "forward")
    assert_close(model.emb.weight.grad, shard(ref.emb.weight.grad, 1, rank, world_size), "emb grad")
    w2 = model.layers[1].w2.weight.grad
    assert_close(w2, shard(ref.layers[1].w2.weight.grad, 1, rank, world_size), "layers.1.w2 grad")


def check_single_style_on_root(rank: int, world_size: int) -> None:
    torch.manual_seed(45)
    ref = nn.Linear(DIM, 2 * world_size)
    layer = parallelize_module(
        copy.deepcopy(ref), None, ColwiseParallel(output_layouts=Replicate())
    )
    x = seeded(46, 3, DIM)
    assert isinstance(layer, ColumnParallelLinear) and layer.gather_output
    assert_close(layer(x), ref(x).detach(), "root Linear")
    row = parallelize_module(copy.deepcopy(ref), None, RowwiseParallel(input_layouts=Replicate()))
    assert isinstance(row, RowParallelLinear) and not row.input_is_parallel
    assert_close(row(x), ref(x).detach(), "root Linear, rowwise with replicated input")


def check_style_errors(rank: int, world_size: int) -> None:
    model = _Block()
    expect_error(
        lambda: parallelize_module(model, None, {"nope": ColwiseParallel()}),
        r"^parallelize_module: plan key 'nope' matches no submodule$",
    )
    expect_error(
        lambda: parallelize_module(
            model, None, {"w1": ColwiseParallel(), "norm": ColwiseParallel()}
        ),
        r"^parallelize_module: 'norm': ColwiseParallel applies to nn.Linear or nn.Embedding, "
        r"not LayerNorm$",
    )
    expect_error(
        lambda: parallelize_module(model, None, {"w1": "colwise"}),
        r"plan\['w1'\] is not a ParallelStyle",
    )
    expect_error(
        lambda: parallelize_module(model, None, {"": SequenceParallel(), "w1": ColwiseParallel()}),
        r"plan targets overlap at 'w1'",
    )
    expect_error(
        lambda: parallelize_module(model, None, {"w1": ColwiseParallel(output_layouts=Shard(1))}),
        r"'w1': ColwiseParallel: output_layouts must be Shard\(-1\) or Replicate\(\), "
        r"got Shard\(dim=1\)",
    )
    expect_error(
        lambda: parallelize_module(model, None, {"emb": ColwiseParallel(input_layouts=Shard(1))}),
        r"'emb': ColwiseParallel: embedding ids must be Replicate\(\)",
    )
    expect_error(
        lambda: parallelize_module(model, None, {"w1": ColwiseParallel(input_layouts="x")}),
        r"unsupported layout 'x'; use Replicate\(\) or Shard\(dim\)",
    )
    expect_error(lambda: parallelize_module(model, None), r"a plan is required")
    if world_size > 1:
        bad = nn.Sequential(
            nn.Linear(DIM, 2 * world_size), nn.Linear(2 * world_size, world_size + 1)
        )
        expect_error(
            lambda: parallelize_module(bad, None, {"0": ColwiseParallel(), "1": ColwiseParallel()}),
            rf"^parallelize_module: '1': ColumnParallelLinear: out_features={world_size + 1} "
            rf"is not divisible by the model-parallel group size {world_size}$",
        )
        assert all(type(m) is nn.Linear for m in bad), "nothing replaced after an error"
    assert all(type(getattr(model, n)) is nn.Linear for n in ("w1", "w2", "head")), (
        "model untouched"
    )


@pytest.mark.parametrize("name", [f.__name__ for f in checks_of(sys.modules[__name__])])
def test_parallelize_style_check_holds_on_every_rank(rank_results, name: str) -> None:
    """Each `check_*` above, run on every rank of a real gloo group, holds there."""
    rank_results.verify(name)


def test_process_group_argument_is_used() -> None:
    """Styles are values; the group comes from parallelize_module (single process here)."""
    assert ColwiseParallel() == ColwiseParallel() and Shard(1) != Shard(-1)
    model = parallelize_module(_Block(), None, {"w1": ColwiseParallel()})
    assert model.w1.world_size == 1 and model.w1.pg is None and dist.is_initialized() is False
