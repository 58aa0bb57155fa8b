"""Lookup kernels: fbgemm TBE, the pure-torch fused kernel and the dense kernel agree.

The pure-torch kernel is checked against fbgemm on dims fbgemm takes (multiples of 4), so that
tables fbgemm cannot take (dim 1, 3, ...) train by the same rule.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from recshard.lookup import native_kernel
from recshard.lookup.fused_params import (
    ANY_KERNEL,
    FusedParams,
    OptimType,
    check_backend,
    parse_fused_params,
)
from recshard.lookup.grouped import GroupedLookup
from recshard.lookup.kernels import DenseKernel, FbgemmFusedKernel, TorchFusedKernel
from recshard.lookup.tables import LocalTable
from recshard.modules import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from recshard.types import EmbeddingComputeKernel

needs_fbgemm = pytest.mark.skipif(not ops.fbgemm_available(), reason="fbgemm not importable")


def local_tables(
    dims: List[int],
    pooling: PoolingType,
    kernel=EmbeddingComputeKernel.FUSED,
    optim: OptimType = OptimType.EXACT_SGD,
    pooled: bool = True,
    data_type: DataType = DataType.FP32,
) -> List[LocalTable]:
    config_cls = EmbeddingBagConfig if pooled else EmbeddingConfig
    tables = []
    for i, dim in enumerate(dims):
        extra = {"pooling": pooling} if pooled else {}
        config = config_cls(
            num_embeddings=7,
            embedding_dim=dim,
            name=f"t{i}",
            feature_names=[f"t{i}_a", f"t{i}_b"] if i == 0 else [f"t{i}_a"],
            data_type=data_type,
            **extra,
        )
        tables.append(
            LocalTable(
                config,
                7,
                dim,
                0,
                0,
                kernel,
                pooling,
                FusedParams.parse({"optimizer": optim, "learning_rate": 0.1}, config.name),
            )
        )
    return tables


def features(tables: List[LocalTable], weighted: bool, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = [f for t in tables for f in t.feature_names]
    lengths = torch.randint(0, 4, (len(keys) * 3,), generator=g)
    values = torch.randint(0, 7, (int(lengths.sum()),), generator=g)  # many duplicates
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)


def copy_weights(src, dst) -> None:
    for a, b in zip(src.table_weights(), dst.table_weights()):
        b.data.copy_(a.data)


@needs_fbgemm
@pytest.mark.parametrize("optim", ANY_KERNEL)
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_torch_fused_matches_fbgemm(optim: OptimType, pooling: PoolingType, weighted: bool) -> None:
    if weighted and pooling == PoolingType.MEAN:
        pytest.skip("fbgemm's weighted-MEAN backward omits 1/length; recshard routes it to torch")
    tables = local_tables([4, 8], pooling, optim=optim)
    spec = tables[0].fused_params.optim
    fb = FbgemmFusedKernel(tables, True, spec, torch.device("cpu"))
    th = TorchFusedKernel(tables, True, spec, torch.device("cpu"))
    copy_weights(fb, th)
    for step in range(3):
        kjt = features(tables, weighted, seed=step)
        grad = torch.randn(3, 16, generator=torch.Generator().manual_seed(100 + step))
        out_fb, out_th = fb(kjt), th(kjt)
        torch.testing.assert_close(out_th, out_fb, rtol=1e-5, atol=1e-6)
        out_fb.backward(grad)
        out_th.backward(grad)
        for a, b in zip(fb.table_weights(), th.table_weights()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for sa, sb in zip(fb.optimizer_states(), th.optimizer_states()):
            for name in sa:
                torch.testing.assert_close(
                    sb[name].view_as(sa[name]), sa[name], rtol=1e-5, atol=1e-6
                )


@needs_fbgemm
@pytest.mark.parametrize("optim", ANY_KERNEL)
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_fp16_weights_train_alike_in_both_kernels(
    optim: OptimType, pooling: PoolingType, weighted: bool
) -> None:
    """FP16 tables: fp16 weights, fp32 state and fp32 outputs in both kernels; the torch
    kernel rounds its updates as fbgemm's CPU kernel does, so the weights agree to one fp16
    rounding: bit for bit wherever both kernels' fp32 gradients do (MEAN pooling's 1/length
    can differ in the last fp32 bit, which may flip a rounding)."""
    if weighted and pooling == PoolingType.MEAN:
        pytest.skip("fbgemm's weighted-MEAN backward omits 1/length; recshard routes it to torch")
    torch.manual_seed(0)
    tables = local_tables([4, 8], pooling, optim=optim, data_type=DataType.FP16)
    spec = tables[0].fused_params.optim
    fb = FbgemmFusedKernel(tables, True, spec, torch.device("cpu"))
    th = TorchFusedKernel(tables, True, spec, torch.device("cpu"))
    copy_weights(fb, th)
    assert {w.dtype for k in (fb, th) for w in k.table_weights()} == {torch.float16}
    for step in range(3):
        kjt = features(tables, weighted, seed=step)
        grad = torch.randn(3, 16, generator=torch.Generator().manual_seed(100 + step))
        out_fb, out_th = fb(kjt), th(kjt)
        assert out_fb.dtype == out_th.dtype == torch.float32
        torch.testing.assert_close(out_th, out_fb, rtol=1e-5, atol=1e-6)
        out_fb.backward(grad)
        out_th.backward(grad)
        for a, b in zip(fb.table_weights(), th.table_weights()):
            one_rounding = a.float().abs() * 2.0**-10 + 2.0**-24  # fp16's spacing at |a|
            assert ((a.float() - b.float()).abs() <= one_rounding).all()
            if pooling == PoolingType.SUM:
                assert torch.equal(a, b), (a.float() - b.float()).abs().max()
        for sa, sb in zip(fb.optimizer_states(), th.optimizer_states()):
            for name in sa:
                assert sa[name].dtype == sb[name].dtype == torch.float32
                torch.testing.assert_close(
                    sb[name].view_as(sa[name]), sa[name], rtol=1e-5, atol=1e-6
                )


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_torch_fused_sgd_equals_autograd_step(pooling: PoolingType, weighted: bool) -> None:
    """Fused SGD update == dense kernel's autograd gradient applied by hand."""
    tables = local_tables([3, 4], pooling)
    fused = TorchFusedKernel(tables, True, tables[0].fused_params.optim, torch.device("cpu"))
    dense = DenseKernel(tables, True, torch.device("cpu"))
    copy_weights(fused, dense)
    kjt = features(tables, weighted, seed=7)
    grad = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    out_dense = dense(kjt)
    torch.testing.assert_close(fused(kjt), out_dense)
    fused(kjt).backward(grad)
    out_dense.backward(grad)
    for w_fused, w_dense in zip(fused.table_weights(), dense.table_weights()):
        torch.testing.assert_close(w_fused, w_dense.detach() - 0.1 * w_dense.grad)


@needs_fbgemm
def test_sequence_kernels_match() -> None:
    tables = local_tables([4, 4], PoolingType.NONE, pooled=False)
    spec = tables[0].fused_params.optim
    fb = FbgemmFusedKernel(tables, False, spec, torch.device("cpu"))
    th = TorchFusedKernel(tables, False, spec, torch.device("cpu"))
    copy_weights(fb, th)
    kjt = features(tables, False, seed=3)
    out_fb, out_th = fb(kjt), th(kjt)
    assert out_fb.shape == (kjt.values().numel(), 4)
    torch.testing.assert_close(out_th, out_fb)
    grad = torch.randn_like(out_fb)
    out_fb.backward(grad)
    out_th.backward(grad)
    for a, b in zip(fb.table_weights(), th.table_weights()):
        torch.testing.assert_close(b, a)


def test_duplicates_sum_before_rowwise_update() -> None:
    """Id 2 twice in one bag: the row moves once, by the summed gradient's Adagrad step."""
    tables = local_tables([3], PoolingType.SUM, optim=OptimType.EXACT_ROWWISE_ADAGRAD)[:1]
    kernel = TorchFusedKernel(tables, True, tables[0].fused_params.optim, torch.device("cpu"))
    before = kernel.table_weights()[0].clone()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["t0_a", "t0_b"], torch.tensor([2, 2]), torch.tensor([2, 0, 0, 0, 0, 0])
    )
    kernel(kjt).backward(torch.ones(3, 6))
    g = torch.full((3,), 2.0)  # two occurrences, upstream gradient 1 each
    m = (g * g).mean()
    expected = before[2] - 0.1 * g / (m.sqrt() + 1e-8)
    torch.testing.assert_close(kernel.table_weights()[0][2], expected)


def test_grouped_lookup_mixes_dims_and_kernels() -> None:
    """Dims 1 and 3 go to the torch kernel, 4 to fbgemm (when present); dense stays dense.
    (Adagrad: recshard's own kernel, which takes any dim, runs SGD and row-wise Adagrad.)"""
    fused = local_tables([1, 4, 3], PoolingType.SUM, optim=OptimType.EXACT_ADAGRAD)
    dense = local_tables([2], PoolingType.SUM, kernel=EmbeddingComputeKernel.DENSE)
    dense[0].config.name = "d0"
    dense[0].config.feature_names = ["d0_a"]
    lookup = GroupedLookup(fused + dense, pooled=True, device=torch.device("cpu"))
    kinds = sorted(type(k).__name__ for k in lookup.kernels)
    expected = ["DenseKernel", "TorchFusedKernel"]
    if ops.fbgemm_available():
        expected.append("FbgemmFusedKernel")
    assert kinds == sorted(expected)
    kjt = features(lookup.tables, False, seed=5)
    out = lookup(kjt)
    assert out.shape == (3, sum(lookup.feature_dims))
    # reference: plain embedding_bag per feature from the kernel's own weights
    weights = dict(zip([t.name for t in lookup.tables], lookup.table_weights()))
    columns = []
    for t in lookup.tables:
        for f in t.feature_names:
            jt = kjt[f]
            columns.append(
                torch.nn.functional.embedding_bag(
                    jt.values(), weights[t.name], jt.offsets(), mode="sum", include_last_offset=True
                )
            )
    torch.testing.assert_close(out, torch.cat(columns, dim=1))
    assert isinstance(lookup.kernels[-1], DenseKernel)
    out.sum().backward()
    assert lookup.kernels[-1].weights[0].grad is not None


def test_unsupported_optimizer_names_the_table() -> None:
    with pytest.raises(ValueError, match="table 'big': fused optimizer 'lamb' is not supported"):
        parse_fused_params({"optimizer": "lamb"}, "big")
    with pytest.raises(
        ValueError, match="table 'big': fused optimizer ADAM runs only in fbgemm's CUDA"
    ):
        check_backend(parse_fused_params({"optimizer": "adam"}, "big"), "big", fbgemm_on_cuda=False)


@needs_fbgemm
@pytest.mark.parametrize("optim", ANY_KERNEL)
def test_a_shard_with_no_rows_shares_the_fbgemm_kernel(optim: OptimType) -> None:
    """A row-wise shard with no rows on this rank (a table smaller than the world) stays in
    its neighbours' fbgemm kernel (or recshard's own, which takes 0-row tables as they are):
    one kernel, no join, its weights and state `[0, ...]`, and
    the neighbour trains as the torch kernel does (fbgemm 1.8's CPU backward fails on a 0-row
    table: the kernel holds a phantom row nobody sees)."""
    tables = local_tables([4, 8], PoolingType.SUM, optim=optim)
    tables[0].rows = 0
    lookup = GroupedLookup(tables, pooled=True, device=torch.device("cpu"))
    spec = tables[0].fused_params.optim
    native = native_kernel.covers(tables, True, spec, torch.device("cpu"))  # row-wise Adagrad
    expected = "NativeFusedKernel" if native else "FbgemmFusedKernel"
    assert {type(k).__name__ for k in lookup.kernels} == {expected}
    fb = FbgemmFusedKernel(tables, True, spec, torch.device("cpu"))
    assert [tuple(w.shape) for w in fb.table_weights()] == [(0, 4), (7, 8)]
    assert all(
        s.size(0) == t.rows
        for t, states in zip(tables, fb.optimizer_states())
        for s in states.values()
    )
    th = TorchFusedKernel(tables, True, spec, torch.device("cpu"))
    copy_weights(fb, th)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        lengths = torch.cat(
            [torch.zeros(6, dtype=torch.long), torch.randint(0, 4, (3,), generator=g)]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["t0_a", "t0_b", "t1_a"],
            torch.randint(0, 7, (int(lengths.sum()),), generator=g),
            lengths,
        )
        grad = torch.randn(3, 16, generator=g)
        out_fb, out_th = fb(kjt), th(kjt)
        torch.testing.assert_close(out_fb, out_th, rtol=1e-5, atol=1e-6)
        assert not out_fb[:, :8].any()
        out_fb.backward(grad)
        out_th.backward(grad)
        torch.testing.assert_close(
            fb.table_weights()[1], th.table_weights()[1], rtol=1e-5, atol=1e-6
        )
        for name, state in fb.optimizer_states()[1].items():
            torch.testing.assert_close(
                state, th.optimizer_states()[1][name].view_as(state), rtol=1e-5, atol=1e-6
            )


@needs_fbgemm
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_fbgemm_kernel_runs_under_inference_mode(pooling: PoolingType) -> None:
    """fbgemm's training op has no inference-mode kernel: the lookup falls back to torch ops."""
    kernel = FbgemmFusedKernel(
        local_tables([4, 8], pooling),
        True,
        parse_fused_params({"learning_rate": 0.1}, "t0"),
        torch.device("cpu"),
    )
    kjt = features(kernel.tables, True, seed=3)
    with torch.no_grad():
        expected = kernel(kjt)
    with torch.inference_mode():
        out = kernel(kjt)
    assert out.is_inference()
    torch.testing.assert_close(out, expected)
