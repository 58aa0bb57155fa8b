"""The production features on a GPU (`make test-cuda`; skipped where no GPU is present, or run
on the CPU's fake device with RECSHARD_FAKE_CUDA=1: `tests/fake_device.py`).

One rank on NCCL, everything on `cuda:0`, each checked against the unsharded module on the same
device: variable batch per feature (VBE) through table-, row- and column-wise tables, the
position-weighted feature-processed EBC (outputs, then tables and position weights after a
step), and managed collision over many steps with evictions (outputs and the ids holding each
row). These paths build index tensors inside the library; a tensor left on the CPU shows here.
"""

from __future__ import annotations

import copy
import traceback
from typing import Callable, Dict, List

import fake_device
import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or fake_device.requested()), reason="needs a CUDA GPU"
    ),
]

from ebc_cases import LR, batch, make_ebc, plan_for  # noqa: E402
from ebc_cases import tables as ebc_tables  # noqa: E402
from fp_cases import Model as FpModel  # noqa: E402
from fp_cases import make_fp_ebc  # noqa: E402
from fp_cases import sharder as fp_sharder  # noqa: E402
from mc_cases import KEYS as MC_KEYS  # noqa: E402
from mc_cases import SparseModel, kjt_of, local_ids  # noqa: E402
from multiprocess import run_ranks  # noqa: E402
from vbe_cases import vbe_batch  # noqa: E402

from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder  # noqa: E402
from recshard.distributed.mc_embeddingbag import (  # noqa: E402
    ManagedCollisionEmbeddingBagCollectionSharder,
)
from recshard.distributed.sharding_plan import (  # noqa: E402
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recshard.types import ShardingPlan  # noqa: E402

SGD = {"optimizer": "exact_sgd", "learning_rate": LR}


def _device() -> torch.device:
    return fake_device.cuda_or_fake()


def _full(model: torch.nn.Module, name: str, like: torch.Tensor) -> torch.Tensor:
    """Table `name` assembled from this (only) rank's shards of `model`'s embedding module."""
    full = torch.full_like(like, float("nan"))
    sharded = next(m for m in model.modules() if hasattr(m, "local_table_shards"))
    for table, weight in sharded.local_table_shards()[name]:
        rows, cols = weight.shape
        full[
            table.row_offset : table.row_offset + rows, table.col_offset : table.col_offset + cols
        ] = weight.detach()
    return full


def _vbe_case(kind: str) -> List[str]:
    """Sharded EBC == unsharded on VBE batches: forward, then tables after an SGD step."""
    device = _device()
    reference = make_ebc(weighted=False).to(device)
    plan = construct_module_sharding_plan(
        reference, plan_for(kind, 1, 1, "fused"), world_size=1, device_type="cuda"
    )
    sharder = EmbeddingBagCollectionSharder(fused_params=SGD)
    model = DistributedModelParallel(
        copy.deepcopy(reference), device=device, plan=ShardingPlan({"": plan}), sharders=[sharder]
    )
    problems: List[str] = []
    for step in range(2):
        kjt = vbe_batch(0, step, "user_item", False, ebc_tables()).to(device)
        out, want = model(kjt), reference(kjt)
        if out.values().shape != want.values().shape or not torch.allclose(
            out.values(), want.values(), atol=1e-5
        ):
            problems.append(f"step {step}: forward differs")
            return problems
        grad = torch.randn(want.values().shape, device=device)
        (out.values() * grad).sum().backward()
        reference.zero_grad()
        (want.values() * grad).sum().backward()
        with torch.no_grad():
            for bag in reference.embedding_bags.values():
                bag.weight -= LR * bag.weight.grad
        for name, bag in reference.embedding_bags.items():
            full = _full(model, name, bag.weight)
            if not torch.allclose(full, bag.weight, atol=1e-5):
                problems.append(f"step {step}: table {name} differs")
    return problems


def _fp_case(kind: str) -> List[str]:
    """Position-weighted FP-EBC, fused tables: forward, then tables and position weights."""
    device = _device()
    reference = make_fp_ebc("collection").to(device)
    fp = fp_sharder("fused")
    plan = construct_module_sharding_plan(
        reference, plan_for(kind, 1, 1, "fused"), sharder=fp, world_size=1, device_type="cuda"
    )
    model = DistributedModelParallel(
        FpModel(copy.deepcopy(reference)),
        device=device,
        plan=ShardingPlan({"fp": plan}),
        sharders=[fp],
    )
    dense = [p for n, p in model.named_parameters() if "position_weight" in n]
    opt = torch.optim.SGD(dense, lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    problems: List[str] = []
    for step in range(2):
        kjt = batch(0, step, 4, False, False).to(device)
        out, want = model(kjt), reference(kjt)
        if not torch.allclose(out.values(), want.values(), atol=1e-5):
            return [f"step {step}: forward differs"]
        grad = torch.randn(want.values().shape, device=device)
        (out.values() * grad).sum().backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        (want.values() * grad).sum().backward()
        ref_opt.step()
        for name, bag in reference._embedding_bag_collection.embedding_bags.items():
            if not torch.allclose(_full(model, name, bag.weight), bag.weight, atol=1e-5):
                problems.append(f"step {step}: table {name} differs")
        got = dict(
            (n.split("fp.", 1)[1], p) for n, p in model.named_parameters() if "position" in n
        )
        for name, p in reference.named_parameters():
            if "position_weight" in name and not torch.allclose(got[name], p, atol=1e-5):
                problems.append(f"step {step}: {name} differs")
    return problems


def _mc_case(kind: str) -> List[str]:
    """MC-EBC with evictions: outputs and each row's id equal the unsharded module's."""
    device = _device()
    reference = SparseModel(1, return_remapped=True).to(device)
    model = SparseModel(1, return_remapped=True)
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(fused_params=SGD)
    per_table = {"t0": table_wise(0), "t1": table_wise(0)}
    if kind == "row_wise":
        per_table = {"t0": row_wise(), "t1": row_wise()}
    module_plan = construct_module_sharding_plan(
        model.sparse, per_table, sharder=sharder, world_size=1, device_type="cuda"
    )
    dmp = DistributedModelParallel(
        model, device=device, plan=ShardingPlan({"sparse": module_plan}), sharders=[sharder]
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    problems: List[str] = []
    for step in range(8):
        kjt = kjt_of([local_ids(step, 0)]).to(device)
        out = dmp(kjt)
        out.sum().backward()
        ref_opt.zero_grad()
        want = reference(kjt)
        want.sum().backward()
        ref_opt.step()
        if not torch.allclose(out.detach(), want.detach(), atol=1e-5):
            problems.append(f"step {step}: outputs differ")
        for f in MC_KEYS:
            if not torch.equal(model.remapped[f].values(), reference.remapped[f].values()):
                problems.append(f"step {step}, feature {f}: remapped rows differ")
    return problems


def _each(cases: Dict[str, Callable[[], List[str]]]) -> Dict[str, List[str]]:
    results: Dict[str, List[str]] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception as e:  # noqa: BLE001 - report per case
            results[name] = [f"raised {e!r}\n{traceback.format_exc()}"]
    return results


def _all_cases(rank: int, ws: int) -> Dict[str, List[str]]:
    cases: Dict[str, Callable[[], List[str]]] = {}
    for kind in ("table_wise", "row_wise", "column_wise"):
        cases[f"vbe/{kind}"] = lambda kind=kind: _vbe_case(kind)
        cases[f"position_weighted/{kind}"] = lambda kind=kind: _fp_case(kind)
    for kind in ("table_wise", "row_wise"):
        cases[f"managed_collision/{kind}"] = lambda kind=kind: _mc_case(kind)
    return _each(cases)


def test_vbe_position_weighted_and_managed_collision_on_cuda_match_unsharded() -> None:
    (results,) = run_ranks(1, _all_cases, backend=fake_device.backend(), timeout=300)
    failures = {k: v for k, v in results.items() if v}
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
