"""The fused optimizer's `state_dict()` lays each table's state out like the table: every
per-shard state is a ShardedTensor with global metadata, nothing a plain tensor that differs
between ranks; `torch.distributed.checkpoint` saves it at one world size and loads it at
another."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recshard import ShardingPlan
from recshard.distributed import DistributedModelParallel
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recshard.optim import RowWiseAdagrad, apply_optimizer_in_backward
from recshard.optim.column_state import recshard_key, torchrec_key
from tests.distributed.ebc_cases import batch, make_ebc
from tests.multiprocess import run_ranks

Full = Dict[str, List]  # "fqn/name" -> the whole state tensor as nested lists


class Wrapper(nn.Module):
    def __init__(self, optimizer: type) -> None:
        super().__init__()
        self.ebc = make_ebc(weighted=False)
        apply_optimizer_in_backward(optimizer, self.ebc.parameters(), {"lr": 0.1})

    def forward(self, features: Any) -> torch.Tensor:
        return self.ebc(features).values()


def _dmp(ws: int, optimizer: type) -> DistributedModelParallel:
    """Column-wise t4 keeps its two column shards at any world size (both on rank 0 at 1)."""
    model = Wrapper(optimizer)
    last = ws - 1
    per_table = {
        "t0": table_wise(rank=last),
        "t1": row_wise(),
        "t2": table_wise(rank=0),
        "t3": row_wise(),
        "t4": column_wise(ranks=[0, last]),
    }
    return DistributedModelParallel(
        model,
        plan=ShardingPlan(
            {"ebc": construct_module_sharding_plan(model.ebc, per_table, world_size=ws)}
        ),
    )


def _full_state(state: Dict[str, Dict[str, Any]]) -> Tuple[Full, List[str]]:
    """Every state tensor assembled from all ranks; and the names of plain tensors that are
    not the same on every rank."""
    local: List[Tuple[str, List[int], List[int], List]] = []
    plain: Dict[str, List] = {}
    for fqn, entry in state.items():
        for name, value in entry.items():
            key = f"{fqn}/{name}"
            if isinstance(value, ShardedTensor):
                size = list(value.metadata().size)
                for shard in value.local_shards():
                    local.append((key, size, shard.metadata.shard_offsets, shard.tensor.tolist()))
            elif isinstance(value, torch.Tensor):
                plain[key] = value.tolist()
    gathered: List = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, plain))
    full: Dict[str, torch.Tensor] = {}
    for shards, _ in gathered:
        for key, size, offsets, values in shards:
            tensor = full.setdefault(key, torch.full(size, float("nan")))
            block = torch.tensor(values)
            index = tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))
            tensor[index] = block
    differing = [k for k in plain if any(p.get(k) != plain[k] for _, p in gathered)]
    return {k: v.tolist() for k, v in full.items()}, differing


def _train_and_save(rank: int, ws: int, optimizer: type, path: str) -> Tuple[Full, List[str]]:
    dmp = _dmp(ws, optimizer)
    for step in range(2):
        dmp(batch(rank, step, 4, False, False)).sum().backward()
    state = dmp.fused_optimizer.state_dict()
    dcp.save({"optim": state}, checkpoint_id=path)
    return _full_state(state["state"])


def _load(rank: int, ws: int, optimizer: type, path: str) -> Full:
    dmp = _dmp(ws, optimizer)
    optim = dmp.fused_optimizer
    target = {"optim": optim.state_dict()}
    before, _ = _full_state(target["optim"]["state"])
    assert all(not torch.tensor(v).any() for v in before.values())  # fresh: zeros
    dcp.load(target, checkpoint_id=path)
    optim.load_state_dict(target["optim"])
    return _full_state(optim.state_dict()["state"])[0]


def _round_trip(optimizer: type, tmp_path: Any) -> None:
    path = str(tmp_path / "optim")
    saved = run_ranks(2, _train_and_save, optimizer, path, timeout=180)
    full, differing = saved[0]
    assert differing == [] and saved[1][0] == full
    assert sorted({k.split("/")[0] for k in full}) == [
        f"ebc.embedding_bags.t{i}.weight" for i in range(5)
    ]
    assert any(torch.tensor(v).any() for v in full.values())  # it trained
    loaded = run_ranks(1, _load, optimizer, path, timeout=180)[0]
    assert loaded == full


def test_rowwise_adagrad_state_round_trips_at_another_world_size(tmp_path: Any) -> None:
    # row-wise state of the column-wise table: one accumulator per column shard
    _round_trip(RowWiseAdagrad, tmp_path)


def test_adagrad_state_round_trips_at_another_world_size(tmp_path: Any) -> None:
    _round_trip(torch.optim.Adagrad, tmp_path)


def _names_and_loads(rank: int, ws: int) -> Dict[str, Any]:
    """Trained state under TorchRec's keys; loaded into fresh models from those keys and from
    recshard's earlier bare ones (`momentum1`, `momentum1@col<offset>`)."""
    trained = _dmp(ws, RowWiseAdagrad)
    for step in range(2):
        trained(batch(rank, step, 4, False, False)).sum().backward()
    state = trained.fused_optimizer.state_dict()["state"]
    full, _ = _full_state(state)
    out: Dict[str, Any] = {"keys": {fqn: sorted(entry) for fqn, entry in state.items()}}
    tables = {fqn: fqn.split(".")[-2] for fqn in state}
    old = {fqn: {recshard_key(tables[fqn], k): v for k, v in e.items()} for fqn, e in state.items()}
    for names, given in (("torchrec", state), ("old", old)):
        fresh = _dmp(ws, RowWiseAdagrad)
        fresh.fused_optimizer.load_state_dict({"state": given})
        out[names] = _full_state(fresh.fused_optimizer.state_dict()["state"])[0] == full
    out["in memory"] = sorted(k for entry in trained.fused_optimizer.state.values() for k in entry)
    return out


def test_state_keys_are_torchrecs_and_old_names_still_load() -> None:
    """TorchRec's `<table>.momentum1` under each table's FQN (a column-wise table's per-shard
    accumulators `<table>.momentum1@col<offset>`), in `state_dict()` and in `.state`."""
    for result in run_ranks(2, _names_and_loads, timeout=180):
        keys = result["keys"]
        for i in range(4):
            assert keys[f"ebc.embedding_bags.t{i}.weight"] == [f"t{i}.momentum1"]
        assert keys["ebc.embedding_bags.t4.weight"] == ["t4.momentum1@col0", "t4.momentum1@col4"]
        assert result["torchrec"] and result["old"]
        assert all(k.split(".")[0] in {f"t{i}" for i in range(5)} for k in result["in memory"])


def test_adams_second_moment_takes_torchrecs_name() -> None:
    """TorchRec names the states past the first after fbgemm's keys: Adam's `exp_avg_sq`."""
    assert torchrec_key("t0", "momentum2") == "t0.exp_avg_sq"
    assert torchrec_key("t0", "momentum1@col4") == "t0.momentum1@col4"
    for key in ("momentum1", "momentum2", "momentum1@col4"):
        assert recshard_key("t0", torchrec_key("t0", key)) == key
        assert recshard_key("t0", key) == key  # an old state dict's name
