"""The CUDA paths in one run (`make test-cuda`; skipped where no GPU is present, or run on the
CPU's fake device with RECSHARD_FAKE_CUDA=1: `tests/fake_device.py`, `tests/test_fake_device.py`).

Each test spawns one rank on NCCL and checks a CUDA path against the unsharded modules:
sharded EBC and EC (table-, row-, column-wise) forward, gradients and weights after a step with
the fused CUDA TBE and each optimizer (SGD, row-wise Adagrad, Adam), TrainPipelineSparseDist on
its CUDA streams against the plain loop, and quantized inference against the float tables.
"""

from __future__ import annotations

import copy
import traceback
from typing import Dict, List

import fake_device
import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or fake_device.requested()), reason="needs a CUDA GPU"
    ),
]

from ebc_cases import batch, make_ebc, plan_for  # noqa: E402
from multiprocess import run_ranks  # noqa: E402

from recshard import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor  # noqa: E402
from recshard.distributed import (  # noqa: E402
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    TrainPipelineSparseDist,
)
from recshard.distributed.sharding_plan import (  # noqa: E402
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recshard.optim import (  # noqa: E402
    CombinedOptimizer,
    KeyedOptimizerWrapper,
    in_backward_optimizer_filter,
)
from recshard.quant import QuantEmbeddingBagCollection  # noqa: E402
from recshard.sparse.jagged_ops import fbgemm_available  # noqa: E402
from recshard.types import ShardingPlan  # noqa: E402

LR = 0.05
EPS = 1e-8
BETAS = (0.9, 0.999)
FUSED = {"sgd": "exact_sgd", "rowwise_adagrad": "exact_row_wise_adagrad", "adam": "adam"}
KINDS = ["table_wise", "row_wise", "column_wise"]


def _device() -> torch.device:
    return fake_device.cuda_or_fake()


def _reference_step(
    weight: torch.Tensor,
    grad: torch.Tensor,
    state: Dict[str, torch.Tensor],
    optimizer: str,
    blocks: List[int],
) -> None:
    """The fused optimizer's update on a whole (unsharded) table; Adam and row-wise Adagrad
    update only the rows the batch touched, as fbgemm's TBE does. Row-wise Adagrad keeps one
    accumulator per row per column shard (`blocks`: the shards' widths)."""
    with torch.no_grad():
        if optimizer == "sgd":
            weight -= LR * grad
            return
        touched = grad.abs().sum(dim=1) > 0
        g = grad[touched]
        if optimizer == "rowwise_adagrad":
            start = 0
            for i, width in enumerate(blocks):
                gb = g[:, start : start + width]
                m = state.setdefault(f"m{i}", torch.zeros(weight.size(0), device=weight.device))
                m[touched] += (gb * gb).mean(dim=1)
                step = LR * gb / (m[touched].sqrt() + EPS).unsqueeze(1)
                weight[touched, start : start + width] -= step
                start += width
            return
        step = int(state.setdefault("step", torch.zeros(())).add_(1).item())
        m1 = state.setdefault("m1", torch.zeros_like(weight))
        m2 = state.setdefault("m2", torch.zeros_like(weight))
        m1[touched] = BETAS[0] * m1[touched] + (1 - BETAS[0]) * g
        m2[touched] = BETAS[1] * m2[touched] + (1 - BETAS[1]) * g * g
        m_hat = m1[touched] / (1 - BETAS[0] ** step)
        v_hat = m2[touched] / (1 - BETAS[1] ** step)
        weight[touched] -= LR * m_hat / (v_hat.sqrt() + EPS)


class _Wrap(nn.Module):
    """Holds one embedding module at `m` (its plan key), as a model does."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, kjt: KeyedJaggedTensor):
        return self.m(kjt)


def _ebc_case(kind: str, optimizer: str) -> List[str]:
    device = _device()
    reference = make_ebc(weighted=False).to(device)
    plan = construct_module_sharding_plan(
        reference, plan_for(kind, 1, 1, "fused"), local_size=1, world_size=1, device_type="cuda"
    )
    fused = {"optimizer": FUSED[optimizer], "learning_rate": LR, "eps": EPS}
    if optimizer == "adam":
        fused.update(beta1=BETAS[0], beta2=BETAS[1])
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused)]
    model = DistributedModelParallel(
        _Wrap(copy.deepcopy(reference)),
        device=device,
        plan=ShardingPlan({"m": plan}),
        sharders=sharders,
    )
    problems: List[str] = []
    states: Dict[str, Dict[str, torch.Tensor]] = {}
    for step in range(3):
        kjt = batch(0, step, 4, False, False).to(device)
        out, want = model(kjt), reference(kjt)
        if not torch.allclose(out.values(), want.values(), atol=1e-5):
            problems.append(f"step {step}: forward differs")
        grad = torch.randn(want.values().shape, device=device)
        (out.values() * grad).sum().backward()
        reference.zero_grad()
        (want.values() * grad).sum().backward()
        for name, bag in reference.embedding_bags.items():
            shards = plan[name].shards or []
            split = plan[name].sharding_type == "column_wise"
            blocks = [sh.shard_sizes[1] for sh in shards] if split else [bag.weight.size(1)]
            _reference_step(
                bag.weight, bag.weight.grad, states.setdefault(name, {}), optimizer, blocks
            )
    for name, bag in reference.embedding_bags.items():
        full = _full_table(model, name, bag.weight.shape, device)
        if not torch.allclose(full, bag.weight, atol=1e-4):
            problems.append(f"{name}: weights differ by {(full - bag.weight).abs().max():.3g}")
    return problems


def _full_table(model: nn.Module, name: str, shape: torch.Size, device: torch.device):
    """The table `name` assembled from this (only) rank's shards."""
    full = torch.zeros(shape, device=device)
    for table, weight in model.module.m.local_table_shards()[name]:
        rows, cols = weight.shape
        full[
            table.row_offset : table.row_offset + rows, table.col_offset : table.col_offset + cols
        ] = weight.detach()
    return full


def _all_ebc_cases(rank: int, ws: int) -> Dict[str, List[str]]:
    """Each case's problems. Without fbgemm (the torch kernels run the tables) Adam must be
    refused with the error naming the table, as on CPU."""
    results: Dict[str, List[str]] = {}
    for kind in KINDS:
        for optimizer in FUSED:
            try:
                results[f"{kind}/{optimizer}"] = _ebc_case(kind, optimizer)
                if optimizer == "adam" and not fbgemm_available():
                    results[f"{kind}/{optimizer}"].append("ran without fbgemm: not refused")
            except Exception as e:  # noqa: BLE001 - report per case
                refused = "runs only in fbgemm's CUDA kernel" in str(e) and "'t0'" in str(e)
                if optimizer == "adam" and not fbgemm_available() and refused:
                    results[f"{kind}/{optimizer}"] = []
                else:
                    results[f"{kind}/{optimizer}"] = [f"raised {e!r}\n{traceback.format_exc()}"]
    return results


def test_sharded_ebc_on_nccl_matches_unsharded_with_each_fused_optimizer() -> None:
    (results,) = run_ranks(1, _all_ebc_cases, backend=fake_device.backend(), timeout=300)
    assert not {k: v for k, v in results.items() if v}


def _ec_case(rank: int, ws: int) -> List[str]:
    device = _device()
    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(num_embeddings=40, embedding_dim=8, name="s0", feature_names=["a"]),
        EmbeddingConfig(num_embeddings=30, embedding_dim=8, name="s1", feature_names=["b"]),
    ]
    reference = EmbeddingCollection(tables, device=device)
    plan = construct_module_sharding_plan(
        reference, {"s0": table_wise(0), "s1": row_wise()}, world_size=1, device_type="cuda"
    )
    sharders = [
        EmbeddingCollectionSharder(fused_params={"optimizer": "exact_sgd", "learning_rate": LR})
    ]
    model = DistributedModelParallel(
        _Wrap(copy.deepcopy(reference)),
        device=device,
        plan=ShardingPlan({"m": plan}),
        sharders=sharders,
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 5, 7, 2, 29, 0]), torch.tensor([2, 1, 1, 2])
    ).to(device)
    got, want = model(kjt), reference(kjt)
    return [f for f in ("a", "b") if not torch.allclose(got[f].values(), want[f].values())]


def test_sharded_ec_on_nccl_matches_unsharded() -> None:
    assert run_ranks(1, _ec_case, backend=fake_device.backend(), timeout=120) == [[]]


class _Model(nn.Module):
    """An EBC and a linear head over its pooled output: loss = mean squared output."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = make_ebc(weighted=False)
        self.head = nn.Linear(self.ebc_width(), 1)

    def ebc_width(self) -> int:
        return sum(c.embedding_dim * len(c.feature_names) for c in self.ebc.embedding_bag_configs())

    def forward(self, kjt: KeyedJaggedTensor):
        loss = self.head(self.ebc(kjt).values()).pow(2).mean()
        return loss, loss.detach()


def _pipeline_case(rank: int, ws: int) -> List[str]:
    device = _device()
    torch.manual_seed(0)
    base = _Model()

    def build() -> DistributedModelParallel:
        plan = construct_module_sharding_plan(
            base.ebc, plan_for("table_wise", 1, 1, "fused"), world_size=1, device_type="cuda"
        )
        sharders = [
            EmbeddingBagCollectionSharder(
                fused_params={"optimizer": "exact_sgd", "learning_rate": LR}
            )
        ]
        return DistributedModelParallel(
            copy.deepcopy(base), device=device, plan=ShardingPlan({"ebc": plan}), sharders=sharders
        )

    def optimizer(model: DistributedModelParallel) -> CombinedOptimizer:
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(model.named_parameters())),
            lambda p: torch.optim.SGD(p, lr=LR),
        )
        return CombinedOptimizer([model.fused_optimizer, dense])

    batches = [batch(0, s, 4, False, False) for s in range(5)]
    plain = build()
    plain_opt = optimizer(plain)
    want = []
    for b in batches:
        plain_opt.zero_grad()
        loss, _ = plain(b.to(device))
        loss.backward()
        plain_opt.step()
        want.append(loss.item())
    model = build()
    pipeline = TrainPipelineSparseDist(model, optimizer(model), device)
    it = iter(batches)
    got = []
    while True:
        try:
            got.append(pipeline.progress(it).item())
        except StopIteration:
            break
    return (
        []
        if torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
        else [f"{got} != {want}"]
    )


def test_pipeline_on_cuda_streams_matches_plain_loop() -> None:
    assert run_ranks(1, _pipeline_case, backend=fake_device.backend(), timeout=120) == [[]]


@pytest.mark.skipif(not fbgemm_available(), reason="the quantized kernel is fbgemm's (not loaded)")
def test_quantized_ebc_on_cuda_matches_float_tables() -> None:
    device = _device()
    ebc = make_ebc(weighted=False).to(device)
    qebc = QuantEmbeddingBagCollection.from_float(ebc, dtype=torch.qint8)
    kjt = batch(0, 0, 8, False, False).to(device)
    got, want = qebc(kjt).values().float(), ebc(kjt).values()
    # 8-bit rows: each pooled value within a few steps of its rows' ranges
    assert got.device == device
    assert torch.allclose(got, want, atol=0.1), (got - want).abs().max()
