"""KJTAllToAll against a reference built from every rank's KJT, and the sequence path back.

Ids are globally unique (they encode rank, key and position), so each rank can tell where
every id it receives came from and check the sequence all-to-all, forward and backward.
"""

from __future__ import annotations

import random
from typing import Dict, List, NamedTuple, Tuple

import pytest
import torch
import torch.distributed as dist
from comm_helpers import assert_close, seeded
from multiprocess import run_ranks

from recshard.comm import KJTAllToAll, SequenceEmbeddingsAllToAll
from recshard.comm.recat import rank_order
from recshard.sparse import KeyedJaggedTensor

Bag = List[int]


class Case(NamedTuple):
    name: str
    splits: List[int]
    batch: List[int]  # batch size per rank
    weighted: bool = False
    vbe: bool = False  # a batch size per key (rank r, key k: (r + k) % 3)
    stagger: int = 1
    narrow: bool = False  # `set_id_rows`: ids (< 400 000) travel as int32


def _bags(case: Case, rank: int) -> List[List[Bag]]:
    """bags[k][b]: ids of key k at batch position b on `rank` (ids unique over ranks)."""
    rng = random.Random(1000 * rank + len(case.name))
    bags = []
    for k in range(sum(case.splits)):
        stride = (rank + k) % 3 if case.vbe else case.batch[rank]
        bags.append(
            [
                [rank * 100000 + k * 1000 + 10 * b + i for i in range(rng.randint(0, 3))]
                for b in range(stride)
            ]
        )
    return bags


def _weight(value: int) -> float:
    return (value % 997) / 10.0


def _kjt(case: Case, rank: int) -> KeyedJaggedTensor:
    bags = _bags(case, rank)
    keys = [f"f{k}" for k in range(len(bags))]
    values = [v for key_bags in bags for bag in key_bags for v in bag]
    lengths = torch.tensor([len(bag) for key_bags in bags for bag in key_bags], dtype=torch.int32)
    weights = torch.tensor([_weight(v) for v in values]) if case.weighted else None
    return KeyedJaggedTensor(
        keys,
        torch.tensor(values, dtype=torch.int64),
        weights,
        lengths=lengths,
        stride=None if case.vbe else case.batch[rank],
        stride_per_key_per_rank=[[len(b)] for b in bags] if case.vbe else None,
    )


def _expected(case: Case, rank: int, ws: int) -> Tuple[List[str], List[int], List[int]]:
    """Keys, lengths and values rank `rank` must receive: feature-major, ranks in order."""
    lo = sum(case.splits[:rank])
    keys = [f"f{k}" for k in range(lo, lo + case.splits[rank])]
    all_bags = [_bags(case, r) for r in range(ws)]
    lengths, values = [], []
    for k in range(lo, lo + case.splits[rank]):
        for source in rank_order(ws, case.stagger):
            for bag in all_bags[source][k]:
                lengths.append(len(bag))
                values.extend(bag)
    return keys, lengths, values


def _check_case(case: Case, rank: int, ws: int) -> None:
    kjt = _kjt(case, rank)
    a2a = KJTAllToAll(dist.group.WORLD, case.splits, case.stagger)
    if case.narrow:
        a2a.set_id_rows([400_000] * sum(case.splits))
    splits_awaitable = a2a(kjt)
    tensors_awaitable = splits_awaitable.wait()
    out = tensors_awaitable.wait()
    keys, lengths, values = _expected(case, rank, ws)
    assert out.keys() == keys, (case.name, out.keys(), keys)
    assert out.lengths().tolist() == lengths, (case.name, out.lengths().tolist(), lengths)
    assert out.values().tolist() == values, (case.name, out.values().tolist(), values)
    assert out.lengths().dtype == torch.int32 and out.values().dtype == torch.int64
    if case.weighted:
        assert_close(out.weights(), torch.tensor([_weight(v) for v in values]), case.name)
    else:
        assert out.weights_or_none() is None
    if case.vbe:
        expected = [
            [len(_bags(case, s)[int(key[1:])]) for s in rank_order(ws, case.stagger)]
            for key in keys
        ]
        assert out.stride_per_key_per_rank() == expected, case.name
    else:
        assert out.stride() == sum(case.batch), (case.name, out.stride())
        assert tensors_awaitable.stride_per_rank == case.batch
    assert out.length_per_key() == [sum(lengths_of(out, k)) for k in range(len(keys))]
    sent = [
        kjt.offset_per_key()[sum(case.splits[: r + 1])] - kjt.offset_per_key()[sum(case.splits[:r])]
        for r in range(ws)
    ]
    assert tensors_awaitable.input_splits["values"] == sent, case.name
    received = [sum(1 for v in values if v // 100000 == s) for s in range(ws)]
    assert tensors_awaitable.output_splits["values"] == received, case.name
    if not case.vbe and case.stagger == 1:
        _check_sequence_back(case, rank, ws, kjt, out, tensors_awaitable)


def lengths_of(kjt: KeyedJaggedTensor, key_index: int) -> List[int]:
    return kjt[kjt.keys()[key_index]].lengths().tolist()


def _embedding(values: torch.Tensor) -> torch.Tensor:
    """Row per id, a function of the id: `[N, 3]`."""
    v = values.double()
    return torch.stack([v, -v, v / 7.0], 1).float()


def _check_sequence_back(case, rank, ws, sent_kjt, recv_kjt, awaitable) -> None:  # noqa: ANN001
    """Sequence all-to-all: one row per received id back to its sender, and its gradient."""
    embs = _embedding(recv_kjt.values()).requires_grad_()
    seq = SequenceEmbeddingsAllToAll(dist.group.WORLD, case.splits)
    out = seq(
        embs,
        recv_kjt.lengths(),
        awaitable.input_splits["values"],
        awaitable.output_splits["values"],
        batch_size_per_rank=awaitable.stride_per_rank,
        sparse_features_recat=awaitable.recat,
    ).wait()
    assert_close(out, _embedding(sent_kjt.values()), f"{case.name} sequence forward")
    weights = {r: seeded(4242 + r, _kjt(case, r).values().numel(), 3) for r in range(ws)}
    (out * weights[rank]).sum().backward()
    position: Dict[int, Tuple[int, int]] = {}  # id -> (sender, row in the sender's values)
    for r in range(ws):
        for p, v in enumerate(_kjt(case, r).values().tolist()):
            position[v] = (r, p)
    expected = (
        torch.stack([weights[position[v][0]][position[v][1]] for v in recv_kjt.values().tolist()])
        if embs.numel()
        else embs.detach()
    )
    assert_close(embs.grad, expected / ws, f"{case.name} sequence backward")


def _cases(ws: int) -> List[Case]:
    cases = [
        Case("equal", [2, 1, 3, 1][:ws], [3] * ws),
        Case("weighted", [1, 2, 1, 2][:ws], [2] * ws, weighted=True),
        Case("zero_split", [0, 3, 0, 1][:ws], [2] * ws),
        Case("unequal_batch", [2, 1, 1, 2][:ws], [2, 0, 3, 1][:ws], weighted=True),
        Case("empty_batch", [1, 1, 2, 1][:ws], [0] * ws),
        Case("vbe", [2, 1, 1, 1][:ws], [0] * ws, weighted=True, vbe=True),
    ]
    if ws == 4:
        cases.append(Case("stagger", [1, 2, 1, 1], [1, 2, 3, 2], stagger=2))
        cases.append(Case("stagger_equal", [1, 2, 1, 1], [2] * 4, weighted=True, stagger=2))
    return cases + [c._replace(name=c.name + "_narrow", narrow=True) for c in cases]


def _run_cases(rank: int, ws: int) -> List[str]:
    for case in _cases(ws):
        _check_case(case, rank, ws)
    return [c.name for c in _cases(ws)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_kjt_all_to_all_matches_reference(world_size: int) -> None:
    assert run_ranks(world_size, _run_cases, timeout=90)[0] == [c.name for c in _cases(world_size)]


def _documented_example(
    rank: int, ws: int, weighted: bool
) -> Tuple[List[str], List[int], List[int], List[float] | None]:
    """TorchRec's docstring example: keys A, B, C, splits [2, 1], batch 3 on each rank."""
    a, b, c = 100, 200, 300  # A.Vi = 100 + i, B.Vi = 200 + i, C.Vi = 300 + i
    inputs = {
        0: ([[a], [], [a + 1, a + 2]], [[], [b], []], [[c], [c + 1], []]),
        1: ([[a + 3], [a + 4], []], [[], [b + 1], [b + 2]], [[c + 2], [c + 3], []]),
    }[rank]
    values = [v for key in inputs for bag in key for v in bag]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["A", "B", "C"],
        torch.tensor(values),
        torch.tensor([len(bag) for key in inputs for bag in key]),
        weights=torch.tensor(values, dtype=torch.float32) / 10 if weighted else None,
    )
    out = KJTAllToAll(dist.group.WORLD, [2, 1])(kjt).wait().wait()
    weights = out.weights().tolist() if weighted else None
    return out.keys(), out.lengths().tolist(), out.values().tolist(), weights, out.stride()


@pytest.mark.parametrize("weighted", [False, True])
def test_documented_example(weighted: bool) -> None:
    rank0, rank1 = run_ranks(2, _documented_example, weighted, timeout=60)
    # rank 0:   0      1     2          3      4      5
    #   'A'   [A.V0] None [A.V1,A.V2] [A.V3] [A.V4] None
    #   'B'    None [B.V0] None        None  [B.V1] [B.V2]
    assert rank0[:3] == (
        ["A", "B"],
        [1, 0, 2, 1, 1, 0, 0, 1, 0, 0, 1, 1],
        [100, 101, 102, 103, 104, 200, 201, 202],
    )
    # rank 1:  'C'  [C.V0] [C.V1] None [C.V2] [C.V3] None
    assert rank1[:3] == (["C"], [1, 1, 0, 1, 1, 0], [300, 301, 302, 303])
    assert rank0[4] == rank1[4] == 6
    if weighted:
        assert rank0[3] == pytest.approx([v / 10 for v in rank0[2]])
        assert rank1[3] == pytest.approx([v / 10 for v in rank1[2]])


def _world_size_one(rank: int, ws: int) -> None:
    case = Case("ws1", [3], [2], weighted=True)
    kjt = _kjt(case, 0)
    aw = KJTAllToAll(dist.group.WORLD, [3])(kjt).wait()
    out = aw.wait()
    assert out.keys() == kjt.keys() and out.stride() == 2
    assert torch.equal(out.values(), kjt.values()) and torch.equal(out.lengths(), kjt.lengths())
    assert aw.input_splits["values"] == aw.output_splits["values"] == [kjt.values().numel()]
    embs = _embedding(out.values())
    back = SequenceEmbeddingsAllToAll(dist.group.WORLD, [3])(
        embs, out.lengths(), aw.input_splits["values"], aw.output_splits["values"]
    ).wait()
    assert back is embs


def test_world_size_one_short_circuits() -> None:
    run_ranks(1, _world_size_one, timeout=60)


def _key_order_matches_permute(rank: int, ws: int) -> None:
    """`key_order` (a key sent to several ranks, as column-wise shards need) gives what the
    permuted KJT gives, weights and narrowed ids included."""
    g = torch.Generator().manual_seed(rank)
    keys, batch = ["a", "b", "c"], 3 + rank
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor(keys, values, torch.rand(values.numel(), generator=g), lengths=lengths)
    order = [2, 0, 1, 0, 2, 1][: 2 * ws]  # every rank gets two keys; "a" and "c" go twice
    splits = [2] * ws
    results = []
    for key_order in (None, order):
        a2a = KJTAllToAll(dist.group.WORLD, splits)
        a2a.set_id_rows([1000] * len(order))
        routed = kjt.permute(order) if key_order is None else kjt
        results.append(a2a(routed, key_order=key_order).wait().wait())
    want, got = results
    assert got.keys() == want.keys() and got.stride() == want.stride()
    for name in ("lengths", "values", "weights"):
        assert torch.equal(getattr(got, name)(), getattr(want, name)()), name


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_key_order_routes_like_a_permute(world_size: int) -> None:
    run_ranks(world_size, _key_order_matches_permute, timeout=90)
