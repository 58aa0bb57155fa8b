"""Column/row-parallel linear, the column->row MLP, torchshard-style ParallelLinear and its
converter, seeded initialization and shard_init_helper_, against single-process nn.Linear:
forward values, input gradients and weight gradients (this rank's slice of the reference)."""

from __future__ import annotations

import copy
import itertools
import sys
from typing import Tuple

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import assert_close, checks_of, expect_error, seeded, shard
from torch import nn

from recshard.parallel import (
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    VocabParallelClassifier,
    shard_init_helper_,
)


def _reference(
    linear: nn.Module, x: torch.Tensor, upstream: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output, input grad) of `linear` on `x` for the loss (out * upstream).sum(); the
    parameter gradients land on `linear`."""
    leaf = x.clone().requires_grad_()
    out = linear(leaf)
    (out * upstream).sum().backward()
    return out.detach(), leaf.grad


def check_column_parallel_linear(rank: int, world_size: int) -> None:
    x = seeded(1, 3, 5, 6)
    for bias, gather, stride, skip in itertools.product(
        (True, False), (True, False), (1, 2), (False, True)
    ):
        case = f"bias={bias} gather={gather} stride={stride} skip_bias_add={skip}"
        out_features = 4 * world_size
        torch.manual_seed(11)
        ref = nn.Linear(6, out_features, bias=bias)
        torch.manual_seed(11)
        layer = ColumnParallelLinear(6, out_features, bias, gather, skip, stride=stride)
        upstream = seeded(2, 3, 5, out_features)
        expected, expected_grad = _reference(ref, x, upstream)
        assert_close(
            layer.weight, shard(ref.weight.detach(), 0, rank, world_size, stride), f"{case} init"
        )

        leaf = x.clone().requires_grad_()
        out = layer(leaf)
        if skip:
            out, out_bias = out
            if bias:
                out = out + out_bias
        my_upstream = upstream if gather else shard(upstream, -1, rank, world_size, stride)
        (out * my_upstream).sum().backward()
        master_w, master_b = layer.master_weight, layer.master_bias  # collectives first

        want = expected if gather else shard(expected, -1, rank, world_size, stride)
        assert_close(out, want, f"{case} forward")
        assert_close(leaf.grad, expected_grad, f"{case} input grad")
        assert_close(
            layer.weight.grad,
            shard(ref.weight.grad, 0, rank, world_size, stride),
            f"{case} weight grad",
        )
        assert_close(master_w, ref.weight.detach(), f"{case} master_weight")
        if bias:
            assert_close(
                layer.bias.grad,
                shard(ref.bias.grad, 0, rank, world_size, stride),
                f"{case} bias grad",
            )
            assert_close(master_b, ref.bias.detach(), f"{case} master_bias")
        else:
            assert layer.bias is None and master_b is None


def check_row_parallel_linear(rank: int, world_size: int) -> None:
    in_features = 4 * world_size
    x = seeded(3, 2, 3, in_features)
    upstream = seeded(4, 2, 3, 5)
    for bias, parallel_in, skip in itertools.product((True, False), (False, True), (False, True)):
        case = f"bias={bias} input_is_parallel={parallel_in} skip_bias_add={skip}"
        torch.manual_seed(12)
        ref = nn.Linear(in_features, 5, bias=bias)
        torch.manual_seed(12)
        layer = RowParallelLinear(in_features, 5, bias, parallel_in, skip)
        expected, expected_grad = _reference(ref, x, upstream)

        leaf = (shard(x, -1, rank, world_size) if parallel_in else x).clone().requires_grad_()
        out = layer(leaf)
        if skip:
            out, out_bias = out
            if bias:
                out = out + out_bias
        (out * upstream).sum().backward()
        master_w = layer.master_weight

        assert_close(out, expected, f"{case} forward")
        want_grad = shard(expected_grad, -1, rank, world_size) if parallel_in else expected_grad
        assert_close(leaf.grad, want_grad, f"{case} input grad")
        assert_close(
            layer.weight.grad, shard(ref.weight.grad, 1, rank, world_size), f"{case} weight grad"
        )
        assert_close(master_w, ref.weight.detach(), f"{case} master_weight")
        if bias:
            assert_close(layer.bias.grad, ref.bias.grad, f"{case} bias grad")
            assert_close(layer.master_bias, ref.bias.detach(), f"{case} master_bias")


def _check_mlp(rank: int, world_size: int, pg: dist.ProcessGroup | None, label: str) -> None:
    """Column-parallel (no gather) -> ReLU -> row-parallel (input parallel) == nn.Sequential."""
    torch.manual_seed(13)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    torch.manual_seed(13)
    col = ColumnParallelLinear(6, 8, gather_output=False, pg=pg)
    row = RowParallelLinear(8, 3, input_is_parallel=True, pg=pg)
    assert copy.deepcopy(row).pg is pg, "copies share the process group (groups cannot be copied)"
    x, upstream = seeded(5, 4, 6), seeded(6, 4, 3)
    expected, expected_grad = _reference(ref, x, upstream)
    leaf = x.clone().requires_grad_()
    out = row(torch.relu(col(leaf)))
    (out * upstream).sum().backward()
    ws, r = dist.get_world_size(pg), dist.get_rank(pg)
    assert_close(out, expected, f"{label} forward")
    assert_close(leaf.grad, expected_grad, f"{label} input grad")
    assert_close(col.weight.grad, shard(ref[0].weight.grad, 0, r, ws), f"{label} fc1 weight grad")
    assert_close(col.bias.grad, shard(ref[0].bias.grad, 0, r, ws), f"{label} fc1 bias grad")
    assert_close(row.weight.grad, shard(ref[2].weight.grad, 1, r, ws), f"{label} fc2 weight grad")
    assert_close(row.bias.grad, ref[2].bias.grad, f"{label} fc2 bias grad")


def check_mlp_column_then_row(rank: int, world_size: int) -> None:
    _check_mlp(rank, world_size, None, "world")
    if world_size == 4:  # two independent model-parallel groups of 2: {0, 1} and {2, 3}
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _check_mlp(rank, world_size, groups[rank // 2], "subgroup")


def check_init_method(rank: int, world_size: int) -> None:
    for init in (nn.init.xavier_uniform_, lambda w: nn.init.normal_(w, std=0.02)):
        torch.manual_seed(14)
        full = torch.empty(2 * world_size, 6)
        init(full)
        torch.manual_seed(14)
        col = ColumnParallelLinear(6, 2 * world_size, init_method=init)
        assert_close(col.weight, shard(full, 0, rank, world_size), "column init_method")
        assert_close(col.bias, torch.zeros(2), "column bias starts at zero")
        torch.manual_seed(14)
        full = torch.empty(3, 2 * world_size)
        init(full)
        torch.manual_seed(14)
        row = RowParallelLinear(2 * world_size, 3, init_method=init)
        assert_close(row.weight, shard(full, 1, rank, world_size), "row init_method")


def check_parallel_linear(rank: int, world_size: int) -> None:
    x, upstream = seeded(7, 3, 4 * world_size), seeded(8, 3, 2 * world_size)
    for dim, bias in itertools.product((None, 0, 1, -1), (True, False)):
        case = f"dim={dim} bias={bias}"
        torch.manual_seed(15)
        ref = nn.Linear(4 * world_size, 2 * world_size, bias=bias)
        torch.manual_seed(15)
        layer = ParallelLinear(4 * world_size, 2 * world_size, bias, dim=dim)
        expected, expected_grad = _reference(ref, x, upstream)
        leaf = x.clone().requires_grad_()
        out = layer(leaf)
        (out * upstream).sum().backward()
        master_w, master_b = layer.master_weight, layer.master_bias
        assert_close(out, expected, f"{case} forward")
        assert_close(leaf.grad, expected_grad, f"{case} input grad")
        weight_dim = {None: None, 0: 1, 1: 0, -1: 0}[dim]
        want = (
            ref.weight.grad if dim is None else shard(ref.weight.grad, weight_dim, rank, world_size)
        )
        assert_close(layer.weight.grad, want, f"{case} weight grad")
        assert_close(master_w, ref.weight.detach(), f"{case} master_weight")
        if bias:
            sharded_bias = dim in (1, -1)
            want = shard(ref.bias.grad, 0, rank, world_size) if sharded_bias else ref.bias.grad
            assert_close(layer.bias.grad, want, f"{case} bias grad")
            assert_close(master_b, ref.bias.detach(), f"{case} master_bias")


class _Tower(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.block = nn.Sequential(nn.ReLU(), nn.Linear(2 * width, width), nn.Tanh())
        self.shared = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.fc1(x))
        return self.head(self.shared(self.shared(h)))


def check_convert_parallel_linear(rank: int, world_size: int) -> None:
    width = 2 * world_size
    x = seeded(9, 5, width)
    torch.manual_seed(16)
    model = _Tower(width)
    expected = model(x).detach()
    for dim in (None, 0, 1, -1):
        converted = ParallelLinear.convert_parallel_linear(copy.deepcopy(model), dim)
        linears = [m for m in converted.modules() if isinstance(m, nn.Linear)]
        assert not linears, f"dim={dim}: left {linears}"
        assert converted.block[1].dim == dim and converted.shared.bias is None
        assert_close(converted(x), expected, f"dim={dim} outputs unchanged")
    root = ParallelLinear.convert_parallel_linear(copy.deepcopy(model.head), -1)
    assert isinstance(root, ParallelLinear)
    assert_close(root(x), model.head(x).detach(), "converted root Linear")


def check_shard_init_helper(rank: int, world_size: int) -> None:
    layers = {
        "ParallelLinear dim=-1": (ParallelLinear(4, 2 * world_size, dim=-1), 0, 1),
        "ParallelLinear dim=0": (ParallelLinear(2 * world_size, 4, dim=0), 1, 1),
        "ColumnParallelLinear stride=2": (ColumnParallelLinear(4, 4 * world_size, stride=2), 0, 2),
        "nn.Linear": (nn.Linear(3, 5), None, 1),
    }
    for name, (layer, dim, stride) in layers.items():
        torch.manual_seed(17)
        full = torch.empty(layer.out_features, layer.in_features)
        nn.init.kaiming_normal_(full, a=0, mode="fan_in", nonlinearity="leaky_relu")
        torch.manual_seed(17)
        out = shard_init_helper_(nn.init.kaiming_normal_, layer.weight, a=0, mode="fan_in")
        assert out is layer.weight
        want = full if dim is None else shard(full, dim, rank, world_size, stride)
        assert_close(layer.weight.detach(), want, f"{name}: slice of one full init")


def check_linear_errors(rank: int, world_size: int) -> None:
    n = world_size + 1  # never divisible by world_size > 1
    if world_size > 1:
        expect_error(
            lambda: ColumnParallelLinear(8, n),
            rf"^ColumnParallelLinear: out_features={n} is not divisible by the model-parallel "
            rf"group size {world_size}$",
        )
        expect_error(
            lambda: RowParallelLinear(n, 8), rf"RowParallelLinear: in_features={n} is not divisible"
        )
        expect_error(
            lambda: ParallelLinear(n, 8, dim=0), rf"ParallelLinear: in_features={n} is not"
        )
        expect_error(
            lambda: ParallelLinear(8, n, dim=-1), rf"ParallelLinear: out_features={n} is not"
        )
        expect_error(
            lambda: VocabParallelClassifier(8, n),
            rf"VocabParallelClassifier: num_classes={n} is not",
        )
        model = nn.Sequential(nn.Linear(8, 2 * world_size), nn.Linear(2 * world_size, n))
        expect_error(
            lambda: ParallelLinear.convert_parallel_linear(model, 1),
            rf"layer '1' \({2 * world_size}->{n}\): out_features={n} is not divisible",
        )
        assert all(type(m) is nn.Linear for m in model), "nothing converted after an error"
        row = RowParallelLinear(2 * world_size, 3, input_is_parallel=True)
        expect_error(
            lambda: row(torch.zeros(4, 2 * world_size)),
            rf"RowParallelLinear expected input with last dim in_features/world_size "
            rf"\({2 * world_size}/{world_size}\)=2, got {2 * world_size}",
        )
    expect_error(
        lambda: ColumnParallelLinear(8, 2 * world_size, stride=3),
        rf"out_features={2 * world_size} is not divisible by group size {world_size} x stride 3",
    )
    expect_error(
        lambda: ColumnParallelLinear(8, world_size, stride=0),
        r"stride must be a positive int, got 0",
    )
    for dim in (2, -2, "1", True):
        expect_error(
            lambda dim=dim: ParallelLinear(4, 4, dim=dim),
            rf"dim must be None, 0, 1 or -1, got {dim!r}",
        )
        expect_error(
            lambda dim=dim: ParallelLinear.convert_parallel_linear(nn.Linear(4, 4), dim),
            "dim must be",
        )
    col = ColumnParallelLinear(8, world_size)
    expect_error(
        lambda: col(torch.zeros(2, 6)),
        r"^ColumnParallelLinear expected input with last dim in_features=8, "
        r"got 6 \(shape \(2, 6\)\)$",
    )
    expect_error(lambda: RowParallelLinear(world_size, 2)(torch.zeros(3)), r"in_features=.*, got 3")
    expect_error(
        lambda: ParallelLinear(4, 2 * world_size, dim=0)(torch.zeros(5)), r"in_features=4, got 5"
    )


@pytest.mark.parametrize("name", [f.__name__ for f in checks_of(sys.modules[__name__])])
def test_parallel_linear_check_holds_on_every_rank(rank_results, name: str) -> None:
    """Each `check_*` above, run on every rank of a real gloo group, holds there."""
    rank_results.verify(name)


def test_layers_without_process_group() -> None:
    """Without torch.distributed initialized the layers are their single-process selves."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 6)
    x = torch.randn(3, 4)
    for make in (ColumnParallelLinear, RowParallelLinear, lambda i, o: ParallelLinear(i, o, dim=0)):
        torch.manual_seed(0)
        layer = make(4, 6)
        torch.testing.assert_close(layer(x), ref(x))
        torch.testing.assert_close(layer.master_weight, ref.weight.detach())
