"""GradientClippingOptimizer: TorchRec's clipping cases, bad arguments, and a sharded model's
clipped training equal to the unsharded model's on 2 gloo ranks: model-parallel tables on a
dense kernel count in the one global norm, fused tables are out of reach, replicated
dense layers stay equal across ranks."""

from __future__ import annotations

import copy
import io
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from dmp_cases import TinyDLRM, batch_for, global_loss, make_optimizer
from multiprocess import run_ranks

from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.optim import GradientClipping, GradientClippingOptimizer, KeyedOptimizerWrapper
from recshard.optim.clipping import mark_sharded, sharded_across
from recshard.types import ShardingPlan

NORM, VALUE, NONE = GradientClipping.NORM, GradientClipping.VALUE, GradientClipping.NONE


def clipper(
    grads: List[List[float]], clipping: GradientClipping, max_gradient: float, **kwargs: object
) -> List[float]:
    """Clip the given gradients of fresh params through one step at lr 0; the clipped grads,
    concatenated."""
    params = [torch.nn.Parameter(torch.ones(len(g))) for g in grads]
    inner = KeyedOptimizerWrapper(
        {f"p{i}": p for i, p in enumerate(params)}, lambda ps: torch.optim.SGD(ps, lr=0.0)
    )
    optimizer = GradientClippingOptimizer(inner, clipping, max_gradient, **kwargs)
    for p, g in zip(params, grads):
        p.grad = torch.tensor(g)
    optimizer.step()
    return [v for p in params for v in p.grad.tolist()]


def test_torchrecs_clipping_cases() -> None:
    assert clipper([[1.0, 2.0]], NORM, 0.0) == [0.0, 0.0]
    assert clipper([[0.5, 0.5]], NORM, 1.0) == [0.5, 0.5]
    assert clipper([[2.0, 4.0]], NORM, 1.0) == pytest.approx([2.0 / 20**0.5, 4.0 / 20**0.5])
    scale = 2.0 / (4 + 16 + 16 + 64) ** 0.5
    got = clipper([[2.0, 4.0], [4.0, 8.0]], NORM, 2.0)
    assert got == pytest.approx([2 * scale, 4 * scale, 4 * scale, 8 * scale], rel=1e-5)
    assert clipper([[1.0, 2.0]], VALUE, 0.0) == [0.0, 0.0]
    assert clipper([[0.5, -3.0], [2.0, -0.25]], VALUE, 1.0) == [0.5, -1.0, 1.0, -0.25]
    assert clipper([[3.0, -4.0]], NONE, 0.1) == [3.0, -4.0]
    # inf-norm: the largest |g| is the norm
    assert clipper([[3.0, -4.0], [1.0]], NORM, 2.0, norm_type="inf") == pytest.approx(
        [1.5, -2.0, 0.5], rel=1e-5
    )


def test_total_norm_is_tracked() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    inner = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=0.0))
    optimizer = GradientClippingOptimizer(inner, VALUE, 1.0, track_grad_norm=True)
    assert optimizer.last_total_grad_norm is None
    p.grad = torch.tensor([3.0, -4.0])
    optimizer.step()
    assert optimizer.last_total_grad_norm.item() == pytest.approx(5.0)  # before clipping
    assert p.grad.tolist() == [1.0, -1.0]


def test_meta_params_skip_clipping() -> None:
    p = torch.nn.Parameter(torch.ones(2, device="meta"))
    inner = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=0.0))
    GradientClippingOptimizer(inner, NORM, 1.0).step()  # nothing to clip, no error


def test_marked_params_clip_alone_without_a_process_group() -> None:
    """One process, no torch.distributed: a sharded param is all of it."""
    p = torch.nn.Parameter(torch.ones(2))
    mark_sharded(p, None)
    inner = KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=0.0))
    p.grad = torch.tensor([3.0, 4.0])
    GradientClippingOptimizer(inner, NORM, 1.0).step()
    assert p.grad.tolist() == pytest.approx([0.6, 0.8], rel=1e-5)


def test_sharded_mark_is_dropped_by_pickle() -> None:
    """torch.save of a marked param works; the process group does not travel."""
    p = torch.nn.Parameter(torch.ones(2))
    mark_sharded(p, None)
    assert sharded_across(p) is not None
    buffer = io.BytesIO()
    torch.save(p, buffer)
    buffer.seek(0)
    assert sharded_across(torch.load(buffer, weights_only=False)) is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"clipping": "norm"}, "clipping 'norm' is not a GradientClipping"),
        ({"clipping": NORM, "norm_type": 0.0}, "norm_type=0.0"),
        ({"clipping": NORM, "norm_type": "two"}, "could not convert"),
        ({"clipping": VALUE, "max_gradient": -1.0}, "max_gradient=-1.0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: Dict[str, object], message: str) -> None:
    inner = KeyedOptimizerWrapper(
        {"p": torch.nn.Parameter(torch.ones(1))}, lambda ps: torch.optim.SGD(ps, lr=0.0)
    )
    with pytest.raises(ValueError, match=message):
        GradientClippingOptimizer(inner, **kwargs)


# ---------------------------------------------------------------- sharded vs unsharded

STEPS = 3
CLIPS = [(NORM, 0.05, 2.0), (NORM, 0.02, "inf"), (VALUE, 0.01, 2.0)]


def _plan(kind: str, ws: int) -> ShardingPlan:
    per_table = {
        # dense kernels: the tables have gradients; tc (data-parallel) is replicated
        "mixed": {
            "ta": table_wise(1, compute_kernel="dense"),
            "tb": row_wise(compute_kernel="dense"),
            "tc": data_parallel(),
        },
        # rank 0 holds no table: it must still join the norm's all-reduce
        "one_rank": {t: table_wise(1, compute_kernel="dense") for t in ["ta", "tb", "tc"]},
        "column": {t: column_wise([1, 0], compute_kernel="dense") for t in ["ta", "tb", "tc"]},
        "fused": {"ta": table_wise(1), "tb": row_wise(), "tc": column_wise([0, 1])},
    }[kind]
    return ShardingPlan(
        {"ebc": construct_module_sharding_plan(TinyDLRM("meta").ebc, per_table, world_size=ws)}
    )


def _train(
    model: torch.nn.Module, optimizer, rank: int, ws: int, clip_reference: object | None = None
) -> Dict[str, List[float]]:
    losses, norms = [], []
    for step in range(STEPS):
        dense, kjt, labels = batch_for(step, rank, ws)
        optimizer.zero_grad()
        loss = model(dense, kjt, labels)
        loss.backward()
        if clip_reference is not None:
            norms.append(float(clip_reference()))
        optimizer.step()
        if clip_reference is None:
            norms.append(float(optimizer.last_total_grad_norm))
        losses.append(global_loss(loss, ws))
    return {"losses": losses, "norms": norms}


def _sharded(rank: int, ws: int, kind: str) -> List[Dict[str, List[float]]]:
    results = []
    for clipping, max_gradient, norm_type in CLIPS:
        torch.manual_seed(0)
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "exact_sgd", "learning_rate": 0.05}
        )
        model = DistributedModelParallel(TinyDLRM(), plan=_plan(kind, ws), sharders=[sharder])
        optimizer = GradientClippingOptimizer(
            make_optimizer(model, kind == "fused", False),
            clipping,
            max_gradient,
            norm_type,
            track_grad_norm=True,
        )
        result = _train(model, optimizer, rank, ws)
        dense = torch.cat(
            [
                p.detach().flatten()
                for n, p in model.named_parameters()
                if n.startswith(("dense", "over"))
            ]
        )
        everyone = [torch.empty_like(dense) for _ in range(ws)]
        dist.all_gather(everyone, dense)
        result["replicas_equal"] = [float(all(torch.equal(everyone[0], d) for d in everyone))]
        results.append(result)
    return results


def _unsharded(kind: str) -> List[Dict[str, List[float]]]:
    """One process, the whole batch, torch's clipping over what the sharded run can clip:
    every parameter, or the dense layers only when the tables are fused."""
    results = []
    for clipping, max_gradient, norm_type in CLIPS:
        torch.manual_seed(0)
        model = TinyDLRM()
        optimizer = make_optimizer(model, False, False)
        clipped = [
            p for n, p in model.named_parameters() if kind != "fused" or not n.startswith("ebc")
        ]

        def clip(
            clipping: GradientClipping = clipping,
            max_gradient: float = max_gradient,
            norm_type: object = norm_type,
            clipped: List[torch.Tensor] = clipped,
        ) -> float:
            if clipping == NORM:
                return torch.nn.utils.clip_grad_norm_(
                    clipped, max_gradient, float(norm_type)
                ).item()
            norm = torch.nn.utils.get_total_norm([p.grad for p in clipped], 2.0).item()
            torch.nn.utils.clip_grad_value_(clipped, max_gradient)
            return norm

        results.append(_train(model, optimizer, 0, 1, clip))
    return results


@pytest.mark.parametrize("kind", ["mixed", "one_rank", "column", "fused"])
def test_sharded_clipping_equals_unsharded(kind: str) -> None:
    results = run_ranks(2, _sharded, kind, timeout=300)
    want = _unsharded(kind)
    torch.manual_seed(0)
    plain = TinyDLRM()
    unclipped = _train(plain, make_optimizer(plain, False, False), 0, 1, lambda: 0.0)["losses"]
    for (clipping, max_gradient, norm_type), expected in zip(CLIPS, want):
        case = f"{kind} {clipping.value} {max_gradient} {norm_type}"
        assert abs(expected["losses"][-1] - unclipped[-1]) > 1e-4, case  # clipping bites
        for rank, per_rank in enumerate(results):
            got = copy.deepcopy(per_rank[CLIPS.index((clipping, max_gradient, norm_type))])
            assert got.pop("replicas_equal") == [1.0], f"{case} rank {rank}: dense layers differ"
            for key in ("losses", "norms"):
                torch.testing.assert_close(
                    torch.tensor(got[key]),
                    torch.tensor(expected[key]),
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, k=key, r=rank, c=case: f"{c} rank {r} {k}: {m}",
                )
