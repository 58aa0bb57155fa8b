"""recshard's own C++ kernel (`recshard.lookup.native_kernel`) trains as the torch and fbgemm
fused kernels do: outputs, weights, row-wise Adagrad state (or SGD's none) and
per-sample-weight gradients after several steps, within fp32 summation-order tolerance."""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import List

import pytest
import torch

from recshard.lookup import native_kernel, native_tbe
from recshard.lookup.fused_params import OptimType
from recshard.lookup.grouped import GroupedLookup
from recshard.lookup.kernels import FbgemmFusedKernel, LookupKernel, TorchFusedKernel
from recshard.lookup.native_kernel import NativeFusedKernel
from recshard.lookup.tables import LocalTable
from recshard.modules import DataType, PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse import jagged_ops as ops
from tests.lookup.test_kernels import copy_weights, local_tables

needs_native = pytest.mark.skipif(not native_tbe.available(), reason="_cpu_tbe not built")
CPU = torch.device("cpu")
ROWWISE = OptimType.EXACT_ROWWISE_ADAGRAD
SGD = OptimType.EXACT_SGD


def test_native_kernel_is_built_where_a_compiler_is() -> None:
    """`pip install -e .` builds the extension wherever a C++ compiler exists: a silently
    failed build would leave every test below skipped."""
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine")
    assert native_tbe.available(), "recshard.lookup._cpu_tbe missing: run `pip install -e .`"


def _features(
    tables: List[LocalTable], weighted: bool, seed: int, index_dtype: torch.dtype, batch: int
) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = [f for t in tables for f in t.feature_names]
    lengths = torch.randint(0, 5, (len(keys) * batch,), generator=g).to(index_dtype)
    values = torch.randint(0, 7, (int(lengths.sum()),), generator=g).to(index_dtype)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)


def _assert_same_state(a: LookupKernel, b: LookupKernel) -> None:
    for wa, wb in zip(a.table_weights(), b.table_weights()):
        torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)
    for sa, sb in zip(a.optimizer_states(), b.optimizer_states()):
        for name in sa:
            torch.testing.assert_close(sb[name].view_as(sa[name]), sa[name], rtol=1e-5, atol=1e-6)


def _train_alike(reference: LookupKernel, native: NativeFusedKernel, **kjt_args) -> None:
    """Three steps of both kernels on the same ids and output gradients; per-sample weights
    (when the KJT has them) take a gradient, which both kernels must agree on too."""
    copy_weights(reference, native)
    for step in range(3):
        kjt = _features(reference.tables, seed=step, **kjt_args)
        outputs, sample_grads = [], []
        for kernel in (reference, native):
            weights = kjt.weights_or_none()
            if weights is not None:
                weights = weights.clone().requires_grad_(True)
            part = KeyedJaggedTensor(
                kjt.keys(), kjt.values(), weights, lengths=kjt.lengths(), offsets=kjt.offsets()
            )
            out = kernel(part)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + step))
            out.backward(grad)
            outputs.append(out.detach())
            sample_grads.append(None if weights is None else weights.grad)
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
        if sample_grads[0] is not None:
            torch.testing.assert_close(sample_grads[1], sample_grads[0], rtol=1e-5, atol=1e-5)
        _assert_same_state(reference, native)


@needs_native
@pytest.mark.parametrize("dims", [[64, 64], [4, 8], [3, 5, 128], [32]])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("optim", [ROWWISE, SGD])
def test_native_matches_torch_kernel(
    dims: List[int],
    pooling: PoolingType,
    weighted: bool,
    index_dtype: torch.dtype,
    optim: OptimType,
) -> None:
    tables = local_tables(dims, pooling, optim=optim)
    spec = tables[0].fused_params.optim
    assert native_kernel.covers(tables, True, spec, CPU)
    _train_alike(
        TorchFusedKernel(tables, True, spec, CPU),
        NativeFusedKernel(tables, True, spec, CPU),
        weighted=weighted,
        index_dtype=index_dtype,
        batch=5,
    )


@needs_native
@pytest.mark.skipif(not ops.fbgemm_available(), reason="fbgemm not importable")
@pytest.mark.parametrize("dims", [[64, 64], [4, 8]])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("optim", [ROWWISE, SGD])
def test_native_matches_fbgemm(dims: List[int], pooling: PoolingType, optim: OptimType) -> None:
    tables = local_tables(dims, pooling, optim=optim)
    spec = tables[0].fused_params.optim
    _train_alike(
        FbgemmFusedKernel(tables, True, spec, CPU),
        NativeFusedKernel(tables, True, spec, CPU),
        weighted=False,
        index_dtype=torch.int64,
        batch=6,
    )


@needs_native
def test_grouped_lookup_picks_the_native_kernel_where_it_covers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32 row-wise Adagrad and SGD groups run it (unless RECSHARD_NATIVE_KERNEL=0); Adagrad,
    FP16 and sequence groups do not."""
    for optim in (ROWWISE, SGD):
        covered = local_tables([4, 3], PoolingType.SUM, optim=optim)
        lookup = GroupedLookup(covered, pooled=True, device=CPU)
        assert [type(k) for k in lookup.kernels] == [NativeFusedKernel] * len(lookup.kernels)
        with monkeypatch.context() as env:
            env.setenv(native_kernel.ENV, "0")
            lookup = GroupedLookup(covered, pooled=True, device=CPU)
            assert not any(isinstance(k, NativeFusedKernel) for k in lookup.kernels)
    for tables, pooled in (
        (local_tables([4], PoolingType.SUM, optim=OptimType.EXACT_ADAGRAD), True),
        (local_tables([4], PoolingType.SUM, optim=ROWWISE, data_type=DataType.FP16), True),
        (local_tables([4], PoolingType.NONE, optim=ROWWISE, pooled=False), False),
    ):
        spec = tables[0].fused_params.optim
        assert not native_kernel.covers(tables, pooled, spec, CPU)
        kernels = GroupedLookup(tables, pooled=pooled, device=CPU).kernels
        assert not any(isinstance(k, NativeFusedKernel) for k in kernels)


def test_without_the_library_the_lookup_falls_back_with_one_warning() -> None:
    """A process where `_cpu_tbe` cannot be found (a failed build): fbgemm's kernel (or the
    torch kernel) runs the group, after one warning naming the missing module."""
    code = """
import importlib.abc, logging, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "recshard.lookup._cpu_tbe":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
logging.basicConfig(level=logging.WARNING, format="%(message)s")
import torch
from recshard.lookup.grouped import GroupedLookup
from recshard.lookup.fused_params import OptimType
from recshard.modules import PoolingType
from tests.lookup.test_kernels import local_tables
for _ in range(2):
    tables = local_tables([4, 8], PoolingType.SUM, optim=OptimType.EXACT_ROWWISE_ADAGRAD)
    lookup = GroupedLookup(tables, pooled=True, device=torch.device("cpu"))
    print(sorted({type(k).__name__ for k in lookup.kernels}))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    expected = "FbgemmFusedKernel" if ops.fbgemm_available() else "TorchFusedKernel"
    assert result.stdout.split("\n")[:2] == [f"['{expected}']"] * 2
    assert result.stderr.count("CPU embedding kernel (recshard.lookup._cpu_tbe)") == 1, (
        result.stderr
    )


@needs_native
def test_an_id_outside_its_table_is_an_error_naming_it() -> None:
    """Ids reach the kernel unchecked only under bounds_check_mode NONE: the forward and the
    update refuse an id outside its shard (naming table, feature and id) and write nothing."""
    tables = local_tables([4, 8], PoolingType.SUM, optim=ROWWISE)
    kernel = NativeFusedKernel(tables, True, tables[0].fused_params.optim, CPU)
    before = [w.clone() for w in kernel.table_weights()]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["t0_a", "t0_b", "t1_a"], torch.tensor([1, 2, 3, 7, 0]), torch.tensor([2, 1, 0, 1, 1, 0])
    )
    match = r"table 't0', feature 't0_b': id 7 is outside the shard's rows \[0, 7\)"
    with pytest.raises(ValueError, match=match):
        kernel(kjt)
    with pytest.raises(ValueError, match=match):
        kernel.update(kjt, torch.ones(2, 16))
    for a, b in zip(before, kernel.table_weights()):
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize(
    "case,match",
    [
        ("short weights", "weights: a contiguous float32 buffer of 40 values"),
        ("fp64 weights", "weights: a contiguous float32 buffer"),
        ("offsets past ids", r"within the 3 ids, got values in \[0, 9\]"),
        ("decreasing offsets past ids", "within the 3 ids"),
        ("offsets count", "offsets: 5 entries needed"),
        ("short per-sample weights", "per_sample_weights: a contiguous float32 buffer of 3"),
        ("short grad", "grad_output: a contiguous float32 buffer of 16"),
        ("short momentum", "momentum: a contiguous float32 buffer of 10"),
    ],
)
def test_native_calls_refuse_buffers_it_would_overrun(case: str, match: str) -> None:
    """The C++ side trusts every pointer and length: the wrapper checks them first."""
    layout = native_tbe.TableLayout.of([4, 6], [4, 4], [0, 1])
    weights, momentum = torch.zeros(40), torch.zeros(10)
    ids, offsets, psw = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3, 3]), None
    grad = torch.ones(2, 8)
    if case == "short weights":
        weights = torch.zeros(39)
    elif case == "fp64 weights":
        weights = torch.zeros(40, dtype=torch.float64)
    elif case == "offsets past ids":
        offsets = torch.tensor([0, 1, 2, 3, 9])
    elif case == "decreasing offsets past ids":
        offsets = torch.tensor([0, 8, 2, 3, 3])
    elif case == "offsets count":
        offsets = torch.tensor([0, 1, 3])
    elif case == "short per-sample weights":
        psw = torch.ones(2)
    elif case == "short grad":
        grad = torch.ones(2, 7)
    elif case == "short momentum":
        momentum = torch.zeros(9)
    with pytest.raises(ValueError, match=match):
        if case in ("short grad", "short momentum"):
            native_tbe.backward(
                weights, momentum, layout, ids, offsets, psw, False, grad, 0.1, 1e-8, False
            )
        else:
            native_tbe.forward(weights, layout, ids, offsets, psw, False, 2)
    assert torch.equal(weights, torch.zeros_like(weights))
