"""FP16 tables in checkpoints: the state_dict holds fp16 table shards and fp32 optimizer state
(as TorchRec gives them), a save records float16 in the manifest and loads bit for bit under
another plan and world size, and loading across FP32 / FP16 tables is an error naming the
key and both dtypes (never a silent cast)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from multiprocess import run_ranks

from recshard import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    checkpoint,
)
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recshard.types import ShardingPlan

TABLES = [
    EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="ta", feature_names=["fa"]),
    EmbeddingBagConfig(num_embeddings=9, embedding_dim=3, name="tb", feature_names=["fb"]),
]


def _model(ws: int, data_type: DataType, rows_split: bool) -> DistributedModelParallel:
    torch.manual_seed(0)
    configs = [dataclasses.replace(t, data_type=data_type) for t in TABLES]
    per_table = {
        t.name: row_wise() if rows_split else table_wise(i % ws) for i, t in enumerate(TABLES)
    }
    meta = EmbeddingBagCollection(configs, device="meta")
    plan = ShardingPlan({"": construct_module_sharding_plan(meta, per_table, world_size=ws)})
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_row_wise_adagrad", "learning_rate": 0.1}
    )
    return DistributedModelParallel(EmbeddingBagCollection(configs), plan=plan, sharders=[sharder])


def _train(model: DistributedModelParallel, rank: int, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        lengths = torch.randint(0, 3, (8,), generator=g)
        values = torch.cat(
            [
                torch.randint(0, 20, (int(lengths[:4].sum()),), generator=g),
                torch.randint(0, 9, (int(lengths[4:].sum()),), generator=g),
            ]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], values, lengths)
        model(kjt).values().pow(2).sum().backward()


def _whole(model: DistributedModelParallel, path: str) -> Dict[str, torch.Tensor]:
    """The full tables and their row-wise Adagrad state, read back through a checkpoint."""
    checkpoint.save(path, model, model.fused_optimizer)
    return checkpoint.read_checkpoint(path)


def _dtypes(model: DistributedModelParallel) -> Tuple[List[str], List[str]]:
    weights = sorted(
        f"{k}:{v.dtype}" for k, v in model.state_dict().items() if k.endswith(".weight")
    )
    states = sorted(
        f"{k}.{n}:{v.dtype}"
        for k, entry in model.fused_optimizer.state_dict()["state"].items()
        for n, v in entry.items()
        if isinstance(v, torch.Tensor)
    )
    return weights, states


def round_trip(rank: int, ws: int, path: str) -> Dict[str, object]:
    model = _model(ws, DataType.FP16, rows_split=False)
    _train(model, rank, 2)
    checkpoint.save(path, model, model.fused_optimizer)
    saved = checkpoint.read_checkpoint(path)
    fresh = _model(ws, DataType.FP16, rows_split=True)  # another plan
    checkpoint.load(path, fresh, fresh.fused_optimizer)
    loaded = _whole(fresh, str(Path(path) / "again"))
    fp32 = _model(ws, DataType.FP32, rows_split=True)
    try:
        checkpoint.load(path, fp32, fp32.fused_optimizer)
        error = "loaded"
    except ValueError as e:
        error = str(e)
    return {
        "dtypes": _dtypes(model),
        "equal": sorted(saved) == sorted(loaded)
        and all(torch.equal(saved[k], loaded[k]) for k in saved),
        "saved_dtypes": sorted(f"{k}:{v.dtype}" for k, v in saved.items()),
        "error": error,
    }


def fp32_into_fp16(rank: int, ws: int, path: str) -> str:
    model = _model(ws, DataType.FP32, rows_split=False)
    checkpoint.save(path, model, model.fused_optimizer)
    half = _model(ws, DataType.FP16, rows_split=False)
    try:
        checkpoint.load(path, half, half.fused_optimizer)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_fp16_tables_checkpoint_round_trip_and_refuse_other_dtypes() -> None:
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(2, round_trip, path, timeout=180)
        manifest = (Path(path) / "LATEST").read_text().strip()
        manifest = json.loads((Path(path) / manifest / "manifest.json").read_text())
    weights, states = results[0]["dtypes"]
    assert weights and all(w.endswith("torch.float16") for w in weights), weights
    assert states and all(s.endswith("torch.float32") for s in states), states
    assert all(r["equal"] for r in results)
    saved = results[0]["saved_dtypes"]
    assert [s for s in saved if ".weight:" in s] and all(
        s.endswith("torch.float16") for s in saved if ".weight:" in s
    ), saved
    assert "float16" in json.dumps(manifest)
    for r in results:
        message = r["error"]
        assert "has dtype torch.float16" in message and "torch.float32 in the model" in message


def test_fp32_checkpoint_into_fp16_tables_is_an_error() -> None:
    with tempfile.TemporaryDirectory() as path:
        messages = run_ranks(2, fp32_into_fp16, path, timeout=180)
    for message in messages:
        assert "has dtype torch.float32" in message and "torch.float16 in the model" in message
