"""Shared pieces of the checkpoint tests: a sharded TinyDLRM with Adagrad state, a bit-exact
snapshot of model and optimizer state, and a forger that rewrites a saved checkpoint as an
attacker with write access to its directory would (hashes recomputed, so only the content
checks and an HMAC stand in the way)."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from dmp_cases import TinyDLRM, make_optimizer, train

from recshard import checkpoint
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recshard.optim import CombinedOptimizer
from recshard.types import ShardingPlan


class Payload:
    """A pickle that, when unpickled, creates `marker` (proof that code ran)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Tuple[object, Tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def sharded_dlrm(ws: int, seed: int) -> DistributedModelParallel:
    """TinyDLRM with tables ta, tb, tc table-wise on ranks 0, 1, 0 (fused Adagrad)."""
    torch.manual_seed(seed)
    per_table = {t: table_wise(i % ws) for i, t in enumerate(["ta", "tb", "tc"])}
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(TinyDLRM("meta").ebc, per_table, world_size=ws)}
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_adagrad", "learning_rate": 0.05}
    )
    return DistributedModelParallel(TinyDLRM(), plan=plan, sharders=[sharder])


def trained(ws: int, rank: int, seed: int, steps: int) -> Tuple[Any, CombinedOptimizer]:
    model = sharded_dlrm(ws, seed)
    opt = make_optimizer(model, fused=True, adagrad=True)
    train(model, opt, range(steps), rank, ws)
    return model, opt


def state_bytes(model: DistributedModelParallel, opt: CombinedOptimizer) -> List[bytes]:
    """Every local tensor of model and optimizer state (this rank's shards of sharded ones),
    as raw bytes with dtype and shape: equal lists mean bit-identical state."""
    values = list(checkpoint.model_state_dict(model.module).values())
    for entry in opt.state_dict()["state"].values():
        values += [v for v in entry.values() if isinstance(v, torch.Tensor)]
    tensors: List[torch.Tensor] = []
    for value in values:
        tensors += (
            [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]
        )
    return [
        f"{t.dtype}{tuple(t.shape)}".encode() + t.detach().contiguous().view(-1).numpy().tobytes()
        for t in tensors
    ]


def read_manifest(directory: Path) -> Dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


def write_manifest(directory: Path, doc: Dict[str, Any]) -> None:
    """Write `doc` as the manifest with every listed file's size and SHA-256 recomputed."""
    for name, info in doc["files"].items():
        data = (directory / name).read_bytes()
        info.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    if "extra" in doc:
        data = (directory / "extra.json").read_bytes()
        doc["extra"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (directory / "manifest.json").write_text(json.dumps(doc))


def saved_bytes(value: object) -> bytes:
    """`value` as torch.save writes it (what DCP stores for each entry)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def plant(directory: Path, fqn: str, payload: bytes, name: str = "forged.distcp") -> None:
    """Point the (first) stored chunk of `fqn` at `payload`, written as file `name`."""
    doc = read_manifest(directory)
    (directory / name).write_bytes(payload)
    entry = next(e for e in doc["storage"] if e["fqn"] == fqn)
    entry.update(file=name, file_offset=0, length=len(payload))
    doc["files"][name] = {}
    write_manifest(directory, doc)


def last_stored_key(directory: Path) -> str:
    """The tensor whose bytes come last in the last shard file (read after all the others
    in that file)."""
    doc = read_manifest(directory)
    entry = max(doc["storage"], key=lambda e: (e["file"], e["file_offset"]))
    return entry["fqn"]
