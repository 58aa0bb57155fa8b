"""A two-collection model, a Pipelineable batch, and the loops the train pipelines must match:
the plain loop, and the semi-synchronous loop (embeddings looked up one step stale)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch
import torch.fx
from dmp_cases import global_samples, make_optimizer
from torch import nn

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from recshard.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.types import ShardingPlan

GLOBAL_BATCH = 12


@dataclass
class Batch:
    """`dense_features [B, 3]`, `sparse_features` (KJT of a, b), `labels [B]`, and `idlist`
    (more KJTs by name: `"item"` holds feature c)."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor
    idlist: Dict[str, KeyedJaggedTensor] = field(default_factory=dict)
    index: int = -1  # which global batch this is (to check none is lost or repeated)

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.idlist.items()},
            self.index,
        )

    def pin_memory(self) -> Batch:
        return Batch(
            self.dense_features.pin_memory(),
            self.sparse_features.pin_memory(),
            self.labels.pin_memory(),
            {k: v.pin_memory() for k, v in self.idlist.items()},
            self.index,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.dense_features, self.labels):
            if t.is_cuda:
                t.record_stream(stream)
        self.sparse_features.record_stream(stream)
        for kjt in self.idlist.values():
            kjt.record_stream(stream)


def _kjt(
    keys: List[str], ids: List[List[List[int]]], samples: range, columns: List[int]
) -> KeyedJaggedTensor:
    lengths = [len(ids[s][f]) for f in columns for s in samples]
    values = [i for f in columns for s in samples for i in ids[s][f]]
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths)
    )


def batch_for(step: int, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s slice of global batch `step`."""
    dense, ids, labels = global_samples(step)
    per = GLOBAL_BATCH // world_size
    mine = range(rank * per, (rank + 1) * per)
    return Batch(
        dense[rank * per : (rank + 1) * per],
        _kjt(["a", "b"], ids, mine, [0, 1]),
        labels[rank * per : (rank + 1) * per],
        {"item": _kjt(["c"], ids, mine, [2])},
        step,
    )


def remap_ids(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """Ids computed inside the model (a hash-like remap): the pipeline cannot pre-route them."""
    return KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), (kjt.values() * 3 + 1) % 5, kjt.lengths()
    )


torch.fx.wrap("remap_ids")


class TwoTowerModel(nn.Module):
    """dense MLP + user EBC (a, b) + item EBC (c) + dot interaction + over MLP -> (loss, output)."""

    def __init__(self, computed_item_ids: bool = False) -> None:
        super().__init__()
        self.computed_item_ids = computed_item_ids
        self.dense = nn.Linear(3, 4)
        self.user = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=10, embedding_dim=4, name="ta", feature_names=["a"]
                ),
                EmbeddingBagConfig(
                    num_embeddings=7, embedding_dim=4, name="tb", feature_names=["b"]
                ),
            ]
        )
        self.item = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=5, embedding_dim=4, name="tc", feature_names=["c"]
                ),
            ]
        )
        self.over = nn.Linear(4 + 6, 1)
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, int]]:
        d = torch.relu(self.dense(batch.dense_features))
        item_ids = batch.idlist["item"]
        if self.computed_item_ids:
            item_ids = remap_ids(item_ids)
        embs = torch.cat(
            [self.user(batch.sparse_features).values(), self.item(item_ids).values()], dim=1
        ).view(-1, 3, 4)
        stacked = torch.cat([d.unsqueeze(1), embs], dim=1)  # [B, 4, 4]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))
        rows, cols = torch.triu_indices(4, 4, offset=1)
        logits = self.over(torch.cat([d, dots[:, rows, cols]], dim=1)).squeeze(1)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.index)


def build(
    world_size: int, computed_item_ids: bool = False, data_parallel_a: bool = False
) -> DistributedModelParallel:
    """The same initial weights on every call (seeded); user: a table-wise (or data-parallel)
    + b row-wise, item: c table-wise on the last rank; fused SGD tables."""
    torch.manual_seed(0)
    model = TwoTowerModel(computed_item_ids)
    a_plan = data_parallel() if data_parallel_a else table_wise(0)
    plan = ShardingPlan(
        {
            "user": construct_module_sharding_plan(
                model.user, {"ta": a_plan, "tb": row_wise()}, world_size=world_size
            ),
            "item": construct_module_sharding_plan(
                model.item, {"tc": table_wise(world_size - 1)}, world_size=world_size
            ),
        }
    )
    sharders = [
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "exact_sgd", "learning_rate": 0.05}
        )
    ]
    return DistributedModelParallel(copy.deepcopy(model), plan=plan, sharders=sharders)


def optimizer_for(model: DistributedModelParallel) -> Any:
    return make_optimizer(model, fused=True, adagrad=False)


def plain_loop(model: nn.Module, optimizer: Any, batches: List[Batch]) -> List[Tuple[float, int]]:
    """The reference: zero_grad, forward, backward, step per batch. (loss, batch index) per step."""
    seen = []
    for batch in batches:
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        seen.append((loss.item(), batch.index))
    return seen


def _lookup(model: DistributedModelParallel, batch: Batch) -> Dict[str, KeyedTensor]:
    """Both collections' embeddings of `batch` (with their autograd graphs), as the sharded
    modules' ordinary forwards compute them now."""
    inner = model.module
    return {
        "user": inner.user(batch.sparse_features).wait(),
        "item": inner.item(batch.idlist["item"]).wait(),
    }


def semi_sync_loop(
    model: DistributedModelParallel,
    optimizer: Any,
    batches: List[Batch],
    start_batch: int = 0,
    stash_gradients: bool = False,
) -> List[Tuple[float, int]]:
    """The reference for TrainPipelineSemiSync, written as a plain loop: from batch `start_batch`
    on, batch i+1's embeddings are looked up after batch i's forward and before its backward
    (so without batch i's sparse update); the dense model trains on detached copies, whose
    gradients then run the embeddings' backward. `stash_gradients`: the dense optimizer steps
    on the previous batch's gradients (none at `start_batch`: no step)."""
    seen: List[Tuple[float, int]] = []
    stash: Dict[str, Any] = {}
    looked_up = _lookup(model, batches[0]) if batches else {}
    for i, batch in enumerate(batches):
        embeddings = looked_up
        leaves = {k: kt.values().detach().requires_grad_() for k, kt in embeddings.items()}
        for k, kt in embeddings.items():
            detached = KeyedTensor(kt.keys(), kt.length_per_key(), leaves[k])
            getattr(model.module, k).forward = lambda *_, detached=detached: detached
        optimizer.zero_grad()
        try:
            loss, _ = model(batch)
        finally:
            for k in embeddings:
                del getattr(model.module, k).forward
        stale = i >= start_batch
        if stale and i + 1 < len(batches):
            looked_up = _lookup(model, batches[i + 1])
        loss.backward()
        torch.autograd.backward(
            [kt.values() for kt in embeddings.values()], [leaves[k].grad for k in embeddings]
        )
        skip_step = False
        if stale and stash_gradients:
            for name, param in model.named_parameters():
                previous = stash.pop(name, None)
                if param.grad is not None:
                    stash[name] = param.grad.clone()
                param.grad = previous
            skip_step = i == start_batch
        if not skip_step:
            optimizer.step()
        if not stale and i + 1 < len(batches):
            looked_up = _lookup(model, batches[i + 1])
        seen.append((loss.item(), batch.index))
    return seen


def run_pipeline(
    pipeline: Any, batches: List[Batch], max_steps: int = 100
) -> List[Tuple[float, int]]:
    """`progress` until StopIteration. (loss, batch index) per step."""
    seen = []
    iterator = iter(batches)
    for _ in range(max_steps):
        try:
            loss, _, index = pipeline.progress(iterator)
        except StopIteration:
            return seen
        seen.append((loss.item(), index))
    raise AssertionError(f"no StopIteration after {max_steps} steps")


def model_state(model: DistributedModelParallel) -> Dict[str, torch.Tensor]:
    """This rank's table shards and the dense weights."""
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    for path in ("user", "item"):
        for table, shards in getattr(model.module, path).local_table_shards().items():
            for i, (_, weight) in enumerate(shards):
                state[f"{path}.{table}.{i}"] = weight.detach().clone()
    return state


def state_diff(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> List[str]:
    if set(got) != set(want):
        return [f"keys {sorted(got)} != {sorted(want)}"]
    return [
        f"{k}: max diff {(got[k] - want[k]).abs().max().item():.3g}"
        for k in sorted(got)
        if not torch.allclose(got[k], want[k], atol=1e-6, rtol=0)
    ]
