"""TrainPipelineSparseDist on variable-batch (VBE) batches equals the plain loop: one user row
beside several item rows per sample, brought to one batch by inverse_indices, through a
row-wise, a table-wise and a data-parallel table; losses per step and every weight after."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from multiprocess import run_ranks
from pipeline_cases import optimizer_for, plain_loop, run_pipeline, state_diff
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    TrainPipelineSparseDist,
)
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.types import ShardingPlan

WS = 2
KEYS = ["user", "item", "context"]


@dataclass
class VbeBatch:
    """`sparse_features`: user (one row), item and context (`items` rows) with inverse
    indices to `items` rows; `labels [items]`."""

    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor
    index: int

    def to(self, device: torch.device, non_blocking: bool = False) -> VbeBatch:
        return VbeBatch(
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.index,
        )

    def pin_memory(self) -> VbeBatch:
        return VbeBatch(self.sparse_features.pin_memory(), self.labels.pin_memory(), self.index)

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse_features.record_stream(stream)


def vbe_batch(step: int, rank: int) -> VbeBatch:
    g = torch.Generator().manual_seed(100 * step + rank)
    items = 3 + (step + rank) % 3
    batches = {"user": 1, "item": items, "context": 2}
    lengths = [torch.randint(0, 3, (batches[k],), generator=g) for k in KEYS]
    values = torch.cat([torch.randint(0, 6, (int(n.sum()),), generator=g) for n in lengths])
    inverse = torch.stack(
        [torch.zeros(items, dtype=torch.long), torch.arange(items), torch.arange(items) % 2]
    )
    kjt = KeyedJaggedTensor(
        KEYS,
        values,
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[batches[k]] for k in KEYS],
        inverse_indices=(KEYS, inverse),
    )
    return VbeBatch(kjt, torch.randint(0, 2, (items,), generator=g).float(), step)


class VbeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=6, embedding_dim=4, name=f"t_{k}", feature_names=[k]
                )
                for k in KEYS
            ]
        )
        self.over = nn.Linear(12, 1)
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(
        self, batch: VbeBatch
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, int]]:
        logits = self.over(self.ebc(batch.sparse_features).values()).squeeze(1)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.index)


def build(kernel: str = "fused", directory: str = "") -> DistributedModelParallel:
    """`kernel` "key_value": the row-wise and table-wise tables in files under `directory`
    behind DRAM caches as large as the tables (the tables are tiny)."""
    torch.manual_seed(0)
    model = VbeModel()
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc,
                {
                    "t_user": row_wise(compute_kernel=kernel),
                    "t_item": table_wise(WS - 1, compute_kernel=kernel),
                    "t_context": data_parallel(),
                },
                world_size=WS,
            )
        }
    )
    fused = {"optimizer": "exact_sgd", "learning_rate": 0.05}
    if kernel == "key_value":
        fused.update(ssd_storage_directory=directory, cache_load_factor=1.0)
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    return DistributedModelParallel(copy.deepcopy(model), plan=plan, sharders=[sharder])


def state(model: DistributedModelParallel) -> Dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for table, shards in model.module.ebc.local_table_shards().items():
        for i, (_, weight) in enumerate(shards):
            out[f"ebc.{table}.{i}"] = weight.detach().clone()
    return out


def equivalence(rank: int, ws: int) -> List[str]:
    batches = [vbe_batch(step, rank) for step in range(5)]
    plain = build()
    want = plain_loop(plain, optimizer_for(plain), batches)
    piped = build()
    pipeline = TrainPipelineSparseDist(piped, optimizer_for(piped), torch.device("cpu"))
    got = run_pipeline(pipeline, batches)
    problems = []
    if [i for _, i in got] != [i for _, i in want]:
        problems.append(f"batches {[i for _, i in got]} != {[i for _, i in want]}")
    losses = [(round(a, 5), round(b, 5)) for (a, _), (b, _) in zip(got, want) if abs(a - b) > 1e-6]
    if losses:
        problems.append(f"losses differ (pipeline, plain): {losses}")
    return problems + state_diff(state(piped), state(plain))


def test_pipeline_matches_plain_loop_on_variable_batches() -> None:
    assert run_ranks(WS, equivalence, timeout=200) == [[], []]


def key_value(rank: int, ws: int, directory: str) -> List[str]:
    batches = [vbe_batch(step, rank) for step in range(5)]
    fused = build()
    want = plain_loop(fused, optimizer_for(fused), batches)
    os.makedirs(f"{directory}/rank{rank}", exist_ok=True)
    stored = build("key_value", f"{directory}/rank{rank}")
    got = plain_loop(stored, optimizer_for(stored), batches)
    problems = [
        f"losses {got} != {want}"
        for _ in [0]
        if not all(abs(a - b) < 1e-6 for (a, _), (b, _) in zip(got, want))
    ]
    # a key-value table's parameter views its storage, current as of the last write-back;
    # state_dict() writes every updated row back first (as TorchRec flushes before a state dict)
    stored.state_dict()
    return problems + state_diff(state(stored), state(fused))


def test_key_value_tables_on_variable_batches_train_like_fused_ones(tmp_path) -> None:  # noqa: ANN001
    assert run_ranks(WS, key_value, str(tmp_path), timeout=200) == [[], []]
