"""Property tests of recshard's C++ kernel (`native_kernel`, `native_tbe`) against the pure-torch
fused kernel on drawn groups: empty bags and batches, tables of 0 (a shard) and 1 rows, dims
off the 4/8/16 grid, int32 and int64 ids, duplicate ids, per-sample weights, MEAN,
non-contiguous ids.

Weights, per-sample weights, output gradients and the learning rate are small dyadic numbers,
so the sums over a row's floats (row-wise Adagrad's mean of squares, a per-sample weight's
gradient) are exact whatever order torch's reductions take. Every other rounding step is
taken in torch's order (MEAN divides by the length, the multiplier is lr times a
reciprocal, a fused multiply-add only where fbgemm's weighted bags use one, correctly rounded
square roots), so outputs, weights, momentum and per-sample-weight gradients are the same
bytes, step after step, for SGD and row-wise Adagrad, SUM and MEAN. Only where such a sum
over a row is inexact (MEAN's gradient over a length that is not a power of two, squared;
the rounded weights of a later step dotted with their gradient) are values compared within
a few ulps. The C++ kernel fed the same batch as int32 or int64, contiguous or not, must give
the same bytes as itself.

Bad input reaching the C++ side (bounds_check_mode NONE skips recshard's earlier check): an id
outside its table, offsets that decrease or leave the ids: a ValueError naming table and
feature (and the id), nothing read or written out of bounds, weights and momentum unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recshard import EmbeddingBagConfig
from recshard.lookup import native_tbe
from recshard.lookup.fused_params import FusedParams, OptimType
from recshard.lookup.kernels import LookupKernel, TorchFusedKernel
from recshard.lookup.native_kernel import NativeFusedKernel
from recshard.lookup.tables import LocalTable
from recshard.modules import PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.types import EmbeddingComputeKernel

pytestmark = pytest.mark.skipif(not native_tbe.available(), reason="_cpu_tbe not built")
CPU = torch.device("cpu")
ROWWISE, SGD = OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.EXACT_SGD
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@dataclass
class Case:
    rows: List[int]
    dims: List[int]
    features: List[int]  # features per table
    batch: int
    lengths: List[int]  # [F * B]
    pooling: PoolingType
    optim: OptimType
    weighted: bool
    seed: int

    def tables(self) -> List[LocalTable]:
        out = []
        for i, (rows, dim, count) in enumerate(zip(self.rows, self.dims, self.features)):
            config = EmbeddingBagConfig(
                num_embeddings=max(rows, 1),  # a shard may hold no rows
                embedding_dim=dim,
                name=f"t{i}",
                feature_names=[f"t{i}_f{k}" for k in range(count)],
                pooling=self.pooling,
            )
            params = FusedParams.parse({"optimizer": self.optim, "learning_rate": 0.25}, f"t{i}")
            kind = EmbeddingComputeKernel.FUSED
            out.append(LocalTable(config, rows, dim, 0, 0, kind, self.pooling, params))
        return out

    def ids(self, index_dtype: torch.dtype) -> tuple:
        """(keys, values, lengths, per-sample weights) with ids drawn across each table's
        rows (last row included, many duplicates)."""
        g = torch.Generator().manual_seed(self.seed)
        keys, values = [], []
        bag = 0
        for t, (rows, count) in enumerate(zip(self.rows, self.features)):
            for k in range(count):
                keys.append(f"t{t}_f{k}")
                n = sum(self.lengths[bag : bag + self.batch])
                bag += self.batch
                ids = torch.randint(0, max(rows, 1), (n,), generator=g)
                ids[: min(n, 1)] = rows - 1
                values.append(ids)
        values = torch.cat(values).to(index_dtype)
        lengths = torch.tensor(self.lengths, dtype=index_dtype)
        weights = _dyadic((values.numel(),), 4, g) if self.weighted else None
        return keys, values, lengths, weights


def _dyadic(shape: tuple, scale: int, g: torch.Generator) -> torch.Tensor:
    """Values k / scale, |k| <= 2 * scale: sums of a few of their products are exact in fp32."""
    return torch.randint(-2 * scale, 2 * scale + 1, shape, generator=g).float() / scale


@st.composite
def cases(draw: st.DrawFn) -> Case:
    tables = draw(st.integers(1, 3))
    # 0 rows: a row-wise shard over more ranks than its table has rows (its bags stay empty)
    rows = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7]), min_size=tables, max_size=tables))
    dims = draw(
        st.lists(
            st.sampled_from([1, 3, 4, 5, 8, 12, 17, 32, 33, 64, 128]),
            min_size=tables,
            max_size=tables,
        )
    )
    features = draw(st.lists(st.integers(1, 2), min_size=tables, max_size=tables))
    batch = draw(st.integers(0, 4))
    bags = sum(features) * batch
    lengths = draw(st.lists(st.integers(0, 4), min_size=bags, max_size=bags))
    table_of_bag = [t for t, count in enumerate(features) for _ in range(count * batch)]
    lengths = [n if rows[t] else 0 for n, t in zip(lengths, table_of_bag)]
    return Case(
        rows,
        dims,
        features,
        batch,
        lengths,
        draw(st.sampled_from([PoolingType.SUM, PoolingType.MEAN])),
        draw(st.sampled_from([ROWWISE, SGD])),
        draw(st.booleans()),
        draw(st.integers(0, 2**16)),
    )


def _pair(case: Case) -> tuple:
    tables = case.tables()
    spec = tables[0].fused_params.optim
    reference, native = (
        TorchFusedKernel(tables, True, spec, CPU),
        NativeFusedKernel(tables, True, spec, CPU),
    )
    g = torch.Generator().manual_seed(case.seed + 1)
    for a, b in zip(reference.table_weights(), native.table_weights()):
        a.copy_(_dyadic(tuple(a.shape), 8, g))
        b.copy_(a)
    return reference, native


def _kjt(keys, values, lengths, weights, shape: str) -> KeyedJaggedTensor:  # noqa: ANN001
    """The batch as given (`plain`), or with non-contiguous values and weights (`strided`)."""
    if shape == "strided":
        values = torch.stack([values, torch.full_like(values, -7)], 1)[:, 0]
        if weights is not None:
            weights = torch.stack([weights, torch.full_like(weights, 9.0)], 1)[:, 0]
        assert values.numel() < 2 or not values.is_contiguous()
    return KeyedJaggedTensor(keys, values, weights, lengths=lengths)


def _step(kernel: LookupKernel, kjt: KeyedJaggedTensor, grad_seed: int) -> tuple:
    """Forward, backward with a dyadic output gradient; (output, per-sample-weight grad)."""
    weights = kjt.weights_or_none()
    if weights is not None:
        weights = weights.detach().clone().requires_grad_(True)
    kjt = KeyedJaggedTensor(
        kjt.keys(), kjt.values(), weights, lengths=kjt.lengths(), offsets=kjt.offsets()
    )
    out = kernel(kjt)
    grad = _dyadic(tuple(out.shape), 8, torch.Generator().manual_seed(grad_seed))
    out.backward(grad)
    return out.detach(), None if weights is None else weights.grad


def _state(kernel: LookupKernel) -> List[torch.Tensor]:
    tensors = [w.clone() for w in kernel.table_weights()]
    for states in kernel.optimizer_states():
        tensors += [s.clone().reshape(-1) for s in states.values()]
    return tensors


def _same_bytes(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, what
    assert torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)), (
        f"{what}: not the same bytes, max diff {(a - b).abs().max()}"
    )


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@FUZZ
@given(case=cases(), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_native_kernel_equals_torch_kernel_bytes(case: Case, index_dtype: torch.dtype) -> None:
    _equals_torch_kernel(case, index_dtype)


@pytest.mark.slow
@settings(FUZZ, max_examples=500, derandomize=False)
@given(case=cases(), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_native_kernel_equals_torch_kernel_bytes_many(case: Case, index_dtype: torch.dtype) -> None:
    """The same, 500 fresh random draws a run (`-m slow`; about a minute)."""
    _equals_torch_kernel(case, index_dtype)


def _equals_torch_kernel(case: Case, index_dtype: torch.dtype) -> None:
    """Two steps on the same batch: outputs, per-sample-weight gradients, weights and
    optimizer state as the torch kernel's, the same bytes except where a sum over a row's
    floats is inexact (see the module docstring): the momentum of MEAN-pooled tables with a
    length off 1, 2, 4 (and so the weights and outputs after it), and the per-sample-weight
    gradient once the weights are no longer dyadic."""
    reference, native = _pair(case)
    exact_mean = case.pooling == PoolingType.SUM or all(n in (0, 1, 2, 4) for n in case.lengths)
    exact_state = case.optim == SGD or exact_mean  # weights and momentum, every step
    dyadic_weights = case.optim == SGD and exact_mean  # after step 0 too
    batch = case.ids(index_dtype)
    for step in range(2):  # step 1 reads the weights step 0 updated
        (out_r, sg_r), (out_n, sg_n) = (
            _step(k, _kjt(*batch, "plain"), 100 + step) for k in (reference, native)
        )
        assert out_n.shape == (case.batch, sum(d * f for d, f in zip(case.dims, case.features)))
        (_same_bytes if step == 0 or exact_state else _close)(out_r, out_n, "output")
        if sg_r is not None:
            exact = step == 0 or dyadic_weights
            (_same_bytes if exact else _close)(sg_r, sg_n, "psw grad")
        else:
            assert sg_n is None
        check = _same_bytes if exact_state else _close
        for t, (wr, wn) in enumerate(zip(reference.table_weights(), native.table_weights())):
            check(wr, wn, f"table {t} weights after step {step}")
        for t, (sr, sn) in enumerate(zip(reference.optimizer_states(), native.optimizer_states())):
            assert sr.keys() == sn.keys()
            for name in sr:
                check(sr[name], sn[name].view_as(sr[name]), f"table {t} {name}")


@FUZZ
@given(
    case=cases(),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    shape=st.sampled_from(["plain", "strided"]),
)
def test_native_kernel_gives_the_same_bytes_for_any_id_layout(
    case: Case, index_dtype: torch.dtype, shape: str
) -> None:
    """The same batch as contiguous int64 ids, or as int32 and / or non-contiguous ids and
    weights: the same output, gradients, weights and momentum, byte for byte."""
    _, first = _pair(case)
    _, second = _pair(case)
    out_a, sg_a = _step(first, _kjt(*case.ids(torch.int64), "plain"), 7)
    out_b, sg_b = _step(second, _kjt(*case.ids(index_dtype), shape), 7)
    _same_bytes(out_a, out_b, "output")
    _same_bytes(sg_a, sg_b, "per-sample-weight grad")
    for a, b in zip(_state(first), _state(second)):
        _same_bytes(a, b, "weights / state")


@FUZZ
@given(case=cases(), index_dtype=st.sampled_from([torch.int32, torch.int64]), data=st.data())
def test_an_id_outside_its_table_names_table_feature_and_id(
    case: Case, index_dtype: torch.dtype, data: st.DataObject
) -> None:
    """One id set to its table's row count (or -1): forward and update raise a ValueError
    naming the table, the feature and the id, and change no weight or state byte."""
    keys, values, lengths, weights = case.ids(index_dtype)
    if values.numel() == 0:
        return
    position = data.draw(st.integers(0, values.numel() - 1))
    bounds = torch.tensor(lengths.tolist()).cumsum(0)
    bag = int(torch.searchsorted(bounds, position, right=True))
    feature = bag // case.batch
    table = next(t for t in range(len(case.rows)) if feature < sum(case.features[: t + 1]))
    bad = data.draw(st.sampled_from([case.rows[table], -1, 2**31 - 1]))
    values[position] = bad
    _, native = _pair(case)
    before = _state(native)
    kjt = KeyedJaggedTensor(keys, values, weights, lengths=lengths)
    match = rf"table 't{table}', feature '{keys[feature]}': id {bad} is outside"
    with pytest.raises(ValueError, match=match):
        native(kjt)
    width = sum(d * f for d, f in zip(case.dims, case.features))
    with pytest.raises(ValueError, match=match):
        native.update(kjt, torch.ones(case.batch, width))
    for a, b in zip(before, _state(native)):
        _same_bytes(a, b, "state after a refused step")


def _one_table(rows: int = 4, dim: int = 8) -> tuple:
    layout = native_tbe.TableLayout.of([rows], [dim], [0])
    return layout, torch.arange(rows * dim, dtype=torch.float32), torch.zeros(rows)


@pytest.mark.parametrize(
    "offsets",
    [[0, 5, 1], [0, 2, 1], [0, 1, 0]],
    ids=["past-the-feature", "down-inside", "back-to-zero"],
)
def test_decreasing_offsets_are_refused_before_the_cpp_side(offsets: List[int]) -> None:
    """Offsets that go down but stay inside [0, ids]: the C++ side checks a feature's ids in
    [offsets[f * B], offsets[(f + 1) * B]) only and sizes its scratch by the last offset, so
    a bag reaching outside that range read rows past the table (a segfault here) and wrote
    past its scratch. Refused, naming the bag, before any read or write."""
    layout, weights, momentum = _one_table()
    ids = torch.tensor([0, 10**6, 10**6, 10**6, 10**6])
    before = weights.clone()
    with pytest.raises(ValueError, match=r"offsets must not decrease: bag \d runs from"):
        native_tbe.forward(weights, layout, ids, torch.tensor(offsets), None, False, 2)
    with pytest.raises(ValueError, match=r"offsets must not decrease"):
        native_tbe.backward(
            weights,
            momentum,
            layout,
            ids.clamp(max=3),
            torch.tensor(offsets),
            None,
            False,
            torch.ones(2, 8),
            0.5,
            1e-8,
            False,
        )
    _same_bytes(before, weights, "weights")


def test_decreasing_offsets_in_a_batch_name_table_and_feature() -> None:
    """A KJT whose offsets (given beside consistent lengths) send one feature's bag into
    another feature's ids, all valid for their own table: the C++ kernel refuses, naming
    the table and feature of the bag, instead of reading table t0 at row 900."""
    rows, dims = [2, 1000], [4, 4]
    case = Case(rows, dims, [1, 1], 2, [1, 1, 1, 1], PoolingType.SUM, ROWWISE, False, 0)
    _, native = _pair(case)
    values = torch.tensor([0, 1, 900, 901])
    kjt = KeyedJaggedTensor(
        ["t0_f0", "t1_f0"],
        values,
        lengths=torch.tensor([1, 1, 1, 1]),
        offsets=torch.tensor([0, 4, 2, 3, 4]),
    )
    with pytest.raises(ValueError, match=r"table 't0', feature 't0_f0': offsets must not decr"):
        native(kjt)


def test_positions_past_32_bits_are_refused() -> None:
    """The C++ side keys each bag's output-gradient row by a uint32: an output gradient of
    2**32 floats or more would wrap and update the wrong rows. Refused (the kernel falls back
    to torch's code for such batches) before any read."""
    layout = native_tbe.TableLayout.of([4], [2**12], [0])
    weights = torch.zeros(4 * 2**12)
    batch = (
        2**20 + 1
    )  # [2**20 + 1, 2**12]: over 2**32 floats, not allocated (the check reads shapes only)
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="32-bit positions"):
        native_tbe.forward(
            weights, layout, torch.zeros(0, dtype=torch.int64), offsets, None, False, batch
        )


@pytest.mark.parametrize("where", ["indices", "offsets", "grad_output"])
def test_tensors_off_the_cpu_are_refused(where: str) -> None:
    """A tensor on another device (a CUDA batch given to a CPU-sharded table) would reach the
    C++ side as a device pointer read on the host; refused naming it (`meta` stands in for a
    device this machine may not have)."""
    layout, weights, momentum = _one_table()
    tensors = {
        "indices": torch.tensor([0, 3]),
        "offsets": torch.tensor([0, 1, 2]),
        "grad_output": torch.ones(2, 8),
    }
    tensors[where] = tensors[where].to("meta")
    call = {"indices": tensors["indices"], "offsets": tensors["offsets"]}
    with pytest.raises(ValueError, match=rf"{where} must be on the CPU .* got meta"):
        if where == "grad_output":
            native_tbe.backward(
                weights,
                momentum,
                layout,
                *call.values(),
                None,
                False,
                tensors[where],
                0.5,
                1e-8,
                False,
            )
        else:
            native_tbe.forward(weights, layout, *call.values(), None, False, 2)
