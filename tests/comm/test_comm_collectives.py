"""Every pooled collective, forward and backward, against a single-process reference.

Each rank rebuilds all ranks' inputs from seeds, runs the collective for real, and checks
its output and its input gradient (of a random linear function of every rank's output)
against autograd on the reference. All cases of one world size run in one process group.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple

import pytest
import torch
import torch.distributed as dist
from comm_helpers import assert_close, reference_grads, seeded
from multiprocess import run_ranks

from recshard.comm import (
    EmbeddingsAllToOne,
    EmbeddingsAllToOneReduce,
    PooledEmbeddingsAllGather,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    VariableBatchPooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsReduceScatter,
    all_gather_base_pooled,
    alltoall_pooled,
    alltoallv,
    get_gradient_division,
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
    set_gradient_division,
    transport,
    variable_batch_alltoall_pooled,
)
from recshard.comm.request import set_use_native_reduce_scatter

Tensors = List[torch.Tensor]


class Case(NamedTuple):
    name: str
    make_input: Callable[[int], torch.Tensor]  # rank -> that rank's input
    run: Callable[[torch.Tensor], torch.Tensor]  # this rank's input -> output (waited)
    reference: Callable[[Tensors], Tensors]  # all inputs -> all outputs
    divides: bool = True


def _pooled_case(name: str, ws: int, batch: List[int], dims: List[int], seed: int) -> Case:
    starts = [sum(batch[:r]) for r in range(ws)]

    def reference(xs: Tensors) -> Tensors:
        return [torch.cat([x[starts[r] : starts[r] + batch[r]] for x in xs], 1) for r in range(ws)]

    return Case(
        name,
        lambda r: seeded(seed + r, sum(batch), dims[r]),
        lambda x: alltoall_pooled(x, batch, dims).wait(),
        reference,
    )


def _reduce_scatter_cases(ws: int, seed: int) -> List[Case]:
    splits = [2, 0, 3, 1][:ws]
    starts = [sum(splits[:r]) for r in range(ws)]

    def ref_v(xs: Tensors) -> Tensors:
        total = torch.stack(xs).sum(0)
        return [total[starts[r] : starts[r] + splits[r]] for r in range(ws)]

    def ref_base(xs: Tensors) -> Tensors:
        return list(torch.stack(xs).sum(0).chunk(ws))

    sizes = [(r + 1, 2) for r in range(ws)]  # reduce_scatter_pooled: one shape per destination

    def as_list(x: torch.Tensor) -> Tensors:
        return [blk.view(s) for blk, s in zip(x.split([a * b for a, b in sizes]), sizes)]

    def ref_list(xs: Tensors) -> Tensors:
        return as_list(torch.stack(xs).sum(0))

    return [
        Case(
            "rs_base",
            lambda r: seeded(seed + r, 3 * ws, 4),
            lambda x: reduce_scatter_base_pooled(x).wait(),
            ref_base,
        ),
        Case(
            "rs_v",
            lambda r: seeded(seed + 10 + r, sum(splits), 3),
            lambda x: reduce_scatter_v_pooled(x, splits).wait(),
            ref_v,
        ),
        Case(
            "rs_v_empty",
            lambda r: seeded(seed + 20 + r, 0, 3),
            lambda x: reduce_scatter_v_pooled(x, [0] * ws).wait(),
            lambda xs: [xs[0][:0] for _ in range(ws)],
        ),
        Case(
            "rs_list",
            lambda r: seeded(seed + 30 + r, sum(a * b for a, b in sizes)),
            lambda x: reduce_scatter_pooled(as_list(x)).wait(),
            ref_list,
        ),
    ]


def _all_gather_case(ws: int, seed: int) -> Case:
    return Case(
        "all_gather",
        lambda r: seeded(seed + r, 2, 3),
        lambda x: all_gather_base_pooled(x).wait(),
        lambda xs: [torch.cat(xs)] * ws,
    )


def _alltoallv_case(ws: int, seed: int) -> Case:
    b_global = 2 * ws + 1  # uneven: the first rank gets one more row
    batch = [b_global // ws + (1 if r < b_global % ws else 0) for r in range(ws)]
    starts = [sum(batch[:r]) for r in range(ws)]
    local_dims = [[1, 2], [3], [], [2, 2]][:ws]  # tables per rank
    out_split = [sum(d) for d in local_dims]

    def run(x: torch.Tensor) -> torch.Tensor:
        tables = list(x.split(local_dims[dist.get_rank()], 1)) or [x]
        return torch.cat(alltoallv(tables, out_split=out_split).wait(), 1)

    def reference(xs: Tensors) -> Tensors:
        return [torch.cat([x[starts[r] : starts[r] + batch[r]] for x in xs], 1) for r in range(ws)]

    return Case(
        "alltoallv",
        lambda r: seeded(seed + r, b_global, out_split[r]),
        run,
        reference,
        divides=False,
    )


def _variable_batch_case(ws: int, seed: int) -> Case:
    features = [[0, 1], [2], [], [3, 4]][:ws]  # global feature ids owned by each rank
    num_features = sum(len(f) for f in features)
    dim = [2, 3, 1, 2, 4]
    # batch[r][k]: rank r's batch size for global feature k (0 allowed)
    batch = [[(r + k) % 3 for k in range(num_features)] for r in range(ws)]

    def size(s: int) -> int:
        return sum(batch[r][k] * dim[k] for r in range(ws) for k in features[s])

    def blocks(x: torch.Tensor, s: int) -> dict:
        sizes = [batch[r][k] * dim[k] for r in range(ws) for k in features[s]]
        keys = [(r, k) for r in range(ws) for k in features[s]]
        return dict(zip(keys, x.split(sizes)))

    def reference(xs: Tensors) -> Tensors:
        per_source = [blocks(x, s) for s, x in enumerate(xs)]
        return [
            torch.cat([per_source[s][(r, k)] for s in range(ws) for k in features[s]])
            for r in range(ws)
        ]

    def run(x: torch.Tensor) -> torch.Tensor:
        me = dist.get_rank()
        return variable_batch_alltoall_pooled(
            x,
            batch_size_per_rank_per_feature=[
                [batch[r][k] for k in features[me]] for r in range(ws)
            ],
            batch_size_per_feature_pre_a2a=[batch[me][k] for s in range(ws) for k in features[s]],
            emb_dim_per_rank_per_feature=[[dim[k] for k in features[s]] for s in range(ws)],
        ).wait()

    return Case("variable_batch", lambda r: seeded(seed + r, size(r)), run, reference)


def _variable_batch_reduce_scatter_case(ws: int, seed: int, module: bool) -> Case:
    """Row-wise VBE: every rank holds partial pools of 3 features for every rank's bags,
    rank-major; rank r gets its chunk summed (batch sizes differ per feature and rank)."""
    dims = [2, 3, 1]
    batch = [[(r + f) % 3 for f in range(3)] for r in range(ws)]  # [rank][feature]
    sizes = [sum(b * d for b, d in zip(batch[r], dims)) for r in range(ws)]

    def run(x: torch.Tensor) -> torch.Tensor:
        if module:
            return VariableBatchPooledEmbeddingsReduceScatter(dist.group.WORLD)(
                x, batch, dims
            ).wait()
        return reduce_scatter_v_per_feature_pooled(x, batch, dims).wait()

    return Case(
        "module_variable_batch_rs" if module else "variable_batch_rs",
        lambda r: seeded(seed + r, sum(sizes)),
        run,
        lambda xs: list(torch.stack(xs).sum(0).split(sizes)),
    )


def _module_cases(ws: int, seed: int) -> List[Case]:
    """The dist modules: callbacks, unequal batches, and that they pick the right collective."""
    pg = dist.group.WORLD
    batch, dims = [1, 3, 0, 2][:ws], [2, 1, 2, 3][:ws]
    a2a = _pooled_case("module_a2a", ws, batch, dims, seed)
    splits = [3, 1, 0, 2][:ws]
    rs = _reduce_scatter_cases(ws, seed + 10)[1]  # reduce-scatter-v over [2, 0, 3, 1]
    vb = _variable_batch_case(ws, seed + 20)
    return [
        a2a._replace(
            run=lambda x: PooledEmbeddingsAllToAll(pg, dims, callbacks=[lambda t: 2 * t])(
                x, batch
            ).wait(),
            reference=lambda xs: [2 * o for o in a2a.reference(xs)],
        ),
        rs._replace(
            name="module_rs_v",
            run=lambda x: PooledEmbeddingsReduceScatter(pg)(x, [2, 0, 3, 1][:ws]).wait(),
        ),
        Case(
            "module_rs_equal",
            lambda r: seeded(seed + 30 + r, 2 * ws, 2),
            lambda x: PooledEmbeddingsReduceScatter(pg)(x, [2] * ws).wait(),
            lambda xs: list(torch.stack(xs).sum(0).chunk(ws)),
        ),
        Case(
            "module_all_gather",
            lambda r: seeded(seed + 40 + r, splits[0], 2),
            lambda x: PooledEmbeddingsAllGather(pg)(x).wait(),
            lambda xs: [torch.cat(xs)] * ws,
        ),
        vb._replace(name="module_variable_batch", run=lambda x: _run_variable_batch_module(x, ws)),
    ]


def _run_variable_batch_module(x: torch.Tensor, ws: int) -> torch.Tensor:
    features = [[0, 1], [2], [], [3, 4]][:ws]
    dim = [2, 3, 1, 2, 4]
    batch = [[(r + k) % 3 for k in range(5)] for r in range(ws)]
    me = dist.get_rank()
    module = VariableBatchPooledEmbeddingsAllToAll(
        dist.group.WORLD, [[dim[k] for k in features[s]] for s in range(ws)]
    )
    return module(
        x,
        [[batch[r][k] for k in features[me]] for r in range(ws)],
        [batch[me][k] for s in range(ws) for k in features[s]],
    ).wait()


def _cases(ws: int) -> List[Case]:
    return [
        _pooled_case("a2a_equal", ws, [3] * ws, [2, 1, 3, 1][:ws], 100),
        _pooled_case("a2a_zero_dim", ws, [2] * ws, [2, 0, 1, 0][:ws], 200),
        _pooled_case("a2a_unequal_batch", ws, [2, 0, 3, 1][:ws], [1, 2, 2, 3][:ws], 300),
        _pooled_case("a2a_empty_batch", ws, [0] * ws, [2, 1, 1, 1][:ws], 400),
        *_reduce_scatter_cases(ws, 500),
        _all_gather_case(ws, 600),
        _alltoallv_case(ws, 700),
        _variable_batch_case(ws, 800),
        _variable_batch_reduce_scatter_case(ws, 850, module=False),
        _variable_batch_reduce_scatter_case(ws, 870, module=True),
        *_module_cases(ws, 900),
    ]


def _check(case: Case, rank: int, ws: int) -> None:
    inputs = [case.make_input(r) for r in range(ws)]
    expected = case.reference(inputs)
    weights = [seeded(9000 + r, *e.shape) for r, e in enumerate(expected)]
    x = inputs[rank].clone().requires_grad_()
    out = case.run(x)
    assert_close(out, expected[rank], f"{case.name} forward")
    (out * weights[rank]).sum().backward()
    grad = reference_grads(inputs, case.reference, weights)[rank]
    if case.divides and get_gradient_division():
        grad = grad / ws
    assert_close(
        x.grad if x.grad is not None else torch.zeros_like(x),
        grad,
        f"{case.name} backward (division {get_gradient_division()})",
    )


def _all_cases(rank: int, ws: int) -> List[str]:
    torch.manual_seed(0)
    done = []
    for case in _cases(ws):
        _check(case, rank, ws)
        done.append(case.name)
    set_gradient_division(False)
    for case in _cases(ws)[:1] + _reduce_scatter_cases(ws, 50):
        _check(case, rank, ws)
    set_gradient_division(True)
    for native in (True, False):  # gloo's own reduce-scatter, then all-to-all + local sum
        set_use_native_reduce_scatter(native)
        for case in _reduce_scatter_cases(ws, 60 + native):
            _check(case, rank, ws)
    set_use_native_reduce_scatter(None)
    return done


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_forward_and_backward(world_size: int) -> None:
    results = run_ranks(world_size, _all_cases, timeout=90)
    assert results[0] == [c.name for c in _cases(world_size)]


def _pooled_in_column_order(rank: int, ws: int) -> bool:
    """Columns in a mixed order (`column_blocks`), parts of ~100 KB: forward and backward."""
    batch, dims = [96, 160, 64][:ws], [80, 48, 112][:ws]
    blocks = [(c, start, 16) for start in range(0, 112, 16) for c in range(ws) if start < dims[c]]
    starts = [sum(batch[:r]) for r in range(ws)]
    inputs = [seeded(70 + r, sum(batch), dims[r]) for r in range(ws)]

    def reference(xs: Tensors) -> Tensors:
        return [
            torch.cat([xs[c][starts[r] : starts[r] + batch[r], a : a + w] for c, a, w in blocks], 1)
            for r in range(ws)
        ]

    expected = reference(inputs)
    weights = [seeded(7000 + r, *e.shape) for r, e in enumerate(expected)]
    for _ in range(3):  # reused buffers, a shared-memory ring that grows
        x = inputs[rank].clone().requires_grad_()
        out = alltoall_pooled(x, batch, dims, column_blocks=blocks).wait()
        assert_close(out, expected[rank], "pooled in column order, forward")
        (out * weights[rank]).sum().backward()
        grad = reference_grads(inputs, reference, weights)[rank] / ws
        assert_close(x.grad, grad, "pooled in column order, backward")
    return transport.uses_shared_memory(dist.group.WORLD)


@pytest.mark.parametrize(
    "env, shm_on",
    [({}, True), ({transport.CAP_ENV: "0.0625"}, True), ({transport.ENV: "0"}, False)],
    ids=["shared_memory", "shared_memory_in_pieces", "gloo"],
)
def test_pooled_all_to_all_lays_columns_on_every_transport(env: dict, shm_on: bool) -> None:
    """Each chunk is laid into the columns from where it is: this rank's input, a peer's part
    in shared memory, or the receive buffer (a part streamed in pieces, or from gloo)."""
    assert run_ranks(3, _pooled_in_column_order, timeout=90, env=env) == [shm_on] * 3


def _world_size_one(rank: int, ws: int) -> None:
    x = seeded(1, 4, 3).requires_grad_()
    assert alltoall_pooled(x, [4], [3]).wait() is x
    assert reduce_scatter_v_pooled(x, [4]).wait() is x
    assert all_gather_base_pooled(x).wait() is x


def test_world_size_one_returns_input() -> None:
    run_ranks(1, _world_size_one, timeout=60)


def test_embeddings_all_to_one() -> None:
    parts = [seeded(r, 3, r + 1).requires_grad_() for r in range(3)]
    joined = EmbeddingsAllToOne(torch.device("cpu"), world_size=3, cat_dim=1)(parts)
    assert_close(joined, torch.cat(parts, 1), "all to one")
    joined.sum().backward()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in parts)
    same = [seeded(r, 2, 2) for r in range(3)]
    summed = EmbeddingsAllToOneReduce(torch.device("cpu"), world_size=3)(same)
    assert_close(summed, same[0] + same[1] + same[2], "all to one reduce")
    with pytest.raises(ValueError, match="expected 3 tensors, got 2"):
        EmbeddingsAllToOne(torch.device("cpu"), 3, 1)(parts[:2])
